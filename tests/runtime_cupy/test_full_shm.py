"""A full ``/dev/shm`` is a setup fault that names the segment, its size and the free
space, and leaves nothing: every segment's pages are reserved when it is made
(``posix_fallocate``), so no process of the run meets the full file system later, at a
write (a SIGBUS). The CLI runs in a private mount namespace whose ``/dev/shm`` is a
tmpfs of one page: the orchestrator's token-out ring fits in it, no stage's ring does.
A full temp folder (``$TMPDIR``, where the edges' folders go) is a setup fault naming
it the same way. Needs root (``unshare --mount``); skipped with the reason elsewhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runtime_cupy.test_process_cli import _env
from tests.support.hygiene import run_resources

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process

#: One page: the token-out ring (a few hundred bytes) fits, an activation ring does not.
SHM_SIZE = "4k"


def _no_namespace() -> str | None:
    if os.geteuid() != 0:
        return "needs root for a private mount namespace with a small /dev/shm (unshare)"
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux)"
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        return f"unshare --mount is refused here: {probe.stderr.decode().strip()}"
    return None


def test_a_full_dev_shm_is_a_named_setup_fault_that_leaves_nothing(
    tiny: str, tmp_path: Path
) -> None:
    reason = _no_namespace()
    if reason is not None:
        pytest.skip(reason)
    left = tmp_path / "left"
    script = (
        f'mount -t tmpfs -o size={SHM_SIZE} tmpfs /dev/shm && "$@"; code=$?; '
        f'ls -A /dev/shm > "{left}"; exit $code'
    )
    cli = [sys.executable, "-m", "runtime_cupy", "--model", tiny, "--stages", "2",
           "--prompt-ids", "1,2,3", "--max-tokens", "4", "--edges", "shm", "--json"]  # fmt: skip
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *cli],
        capture_output=True, text=True, check=False, env=_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])  # not 135: no SIGBUS
    doc = json.loads(proc.stdout)  # exactly one JSON object
    assert doc["outcome"] == "faulted", doc
    fault = doc["fault"]
    assert "setup_failure" in fault and "no space for the shared-memory segment /gpp-" in fault
    assert " bytes asked, " in fault and " bytes free in /dev/shm" in fault, fault
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert lines == [f"error: run faulted: {fault}"], proc.stderr[-3000:]
    assert all(s["exit_status"] == 0 for s in doc["stages"]), doc["stages"]  # none died
    assert left.read_text() == ""  # no segment left in that /dev/shm
    assert run_resources(doc["chain_id"]) == []  # nor an edge folder in /tmp


def test_a_full_temp_folder_is_a_named_setup_fault_that_leaves_nothing(
    tiny: str, tmp_path: Path
) -> None:
    """``$TMPDIR`` a tmpfs with room for the registry of live chains (its folder and the
    chain's entry) and one edge's folder (the folder and its two FIFOs): the next edge's
    consumer cannot make its folder there and the run faults at
    once naming it, not at the readiness bound (120 s) with a stage that waited for a
    ring whose folder it looked for in ``/tmp``, where ``tempfile`` had moved on to."""
    reason = _no_namespace()
    if reason is not None:
        pytest.skip(reason)
    full, left = tmp_path / "tmp", tmp_path / "left"
    full.mkdir()
    script = (
        f'mount -t tmpfs -o size=64k,nr_inodes=6 tmpfs "{full}" && "$@"; code=$?; '
        f'ls -A "{full}" > "{left}"; exit $code'
    )
    cli = [sys.executable, "-m", "runtime_cupy", "--model", tiny, "--stages", "2",
           "--prompt-ids", "1,2,3", "--max-tokens", "4", "--edges", "shm", "--json"]  # fmt: skip
    env = {**_env(), "TMPDIR": str(full)}
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *cli],
        capture_output=True, text=True, check=False, env=env, timeout=100,
    )  # fmt: skip
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    doc = json.loads(proc.stdout)
    assert doc["outcome"] == "faulted", doc
    assert f"no room for the folder {full}/gpp-" in doc["fault"], doc["fault"]
    assert " inodes and " in doc["fault"] and f" bytes free in {full} " in doc["fault"]
    assert doc["timings"]["wall_s"] < 60, doc["timings"]
    assert left.read_text() == ""  # no edge folder left in that temp folder
    assert run_resources(doc["chain_id"]) == []  # nor a segment in /dev/shm
