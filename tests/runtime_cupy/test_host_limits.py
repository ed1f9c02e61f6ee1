"""A limit of this process that a run meets is named, with its value, and the exit
status says the host's resources, not the input, fell short (1, not 2):

- an address-space limit (``ulimit -v``) too small to map the model: the model "cannot
  be mapped: Cannot allocate memory" was exit 2 (bad input), the limit not named;
- a descriptor limit (``ulimit -n``) too small for the stages' pipes: "[Errno 24] Too
  many open files" alone.

The model that cannot be mapped is exit 1 from ``python -m runtime_cupy plan`` and
``python -m runtime_sim run`` too (they said 2, as for a bad file). Each runs the
command with the limit set in the child alone."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from runplan.resource_limits import limit_note
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.runtime_cupy.test_process_cli import _env

#: Room for the interpreter and its modules, far from the model's mapping.
ADDRESS_SPACE = 3 << 30
#: The model's size: its header is a tiny model's, the rest a hole (a sparse file).
MODEL_BYTES = 64 << 30


def _run(
    argv: list[str], limit: int, value: int, module: str = "runtime_cupy"
) -> subprocess.CompletedProcess[str]:
    def limited() -> None:
        resource.setrlimit(limit, (value, value))

    return subprocess.run(
        [sys.executable, "-m", module, *argv, "--json"],
        capture_output=True, text=True, check=False, env=_env(), timeout=120,
        preexec_fn=limited,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("module", "command"),
    [("runtime_cupy", []), ("runtime_cupy", ["plan"]), ("runtime_sim", ["run"])],
    ids=["runtime_cupy", "runtime_cupy-plan", "runtime_sim-run"],
)
def test_a_model_past_the_address_space_limit_is_a_fault_naming_the_limit(
    tmp_path: Path, module: str, command: list[str]
) -> None:
    model = write_model(tmp_path / "large.gguf", ModelShape(n_layers=2))
    with open(model, "r+b") as f:
        f.truncate(MODEL_BYTES)
    argv = [*command, "--model", str(model)]
    if command != ["plan"]:
        argv += ["--prompt-ids", "1,2", "--max-tokens", "1"]
    proc = _run(argv, resource.RLIMIT_AS, ADDRESS_SPACE, module)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    error = json.loads(proc.stdout)["error"]
    assert error["type"] == "GgufUnmapped", error
    words = "cannot be mapped: Cannot allocate memory; the address-space limit (RLIMIT_AS, "
    assert words + f"ulimit -v) is {ADDRESS_SPACE} bytes" in error["message"], error


def test_stages_past_the_descriptor_limit_are_a_fault_naming_the_limit(tiny: str) -> None:
    argv = ["--model", tiny, "--stages", "4", "--prompt-ids", "1,2", "--max-tokens", "1"]
    proc = _run(argv, resource.RLIMIT_NOFILE, 20)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    doc = json.loads(proc.stdout)
    fault = doc["fault"]
    assert "the stages could not be started: [Errno 24] Too many open files" in fault, fault
    assert fault.endswith("; the descriptor limit (ulimit -n) is 20"), fault


def test_no_limit_no_note() -> None:
    assert limit_note(None) == "" and limit_note(0) == ""


def test_every_fault_of_a_descriptor_limit_names_it_until_a_run_fits(tiny: str) -> None:
    """``ulimit -n`` raised one at a time from a limit the stages' pipes pass, until a
    run completes: wherever the run meets the limit first (the stages' pipes, the
    orchestrator's token links, a stage's edges), its fault names the limit and its
    value. The token links' said "OSError: [Errno 24] Too many open files" alone."""
    argv = ["--model", tiny, "--stages", "2", "--prompt-ids", "1,2", "--max-tokens", "1",
            "--worker", "numpy"]  # fmt: skip
    faults = []
    for limit in range(12, 64):
        proc = _run(argv, resource.RLIMIT_NOFILE, limit)
        doc = json.loads(proc.stdout)
        if doc["outcome"] == "completed":
            break
        assert proc.returncode == 1, (limit, proc.returncode, proc.stderr[-2000:])
        faults.append(doc["fault"])
        assert doc["fault"].endswith(f"; the descriptor limit (ulimit -n) is {limit}"), doc
    else:
        raise AssertionError(f"no run completed with up to 63 descriptors: {faults[-1]}")
    assert faults, "the first limit tried left room for a whole run"
