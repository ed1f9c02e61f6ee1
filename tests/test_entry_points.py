"""``python -m runplan | runtime_cupy | runtime_sim`` interrupted while their modules
load (Ctrl-C in the first second of a command) print ``cancelled`` and exit 130, as
they do once the command runs, not a ``KeyboardInterrupt`` traceback; with ``--json``,
the ``Cancelled`` object on standard output (none after the command's own)."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# A fresh interpreter where importing the command's module raises KeyboardInterrupt, as
# Ctrl-C there would; then ``python -m PACKAGE``.
_INTERRUPTED_IMPORT = """
import importlib.abc, runpy, sys

TARGET = sys.argv[2]

class Interrupting(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == TARGET:
            raise KeyboardInterrupt

sys.meta_path.insert(0, Interrupting())
sys.argv = [sys.argv[1], *sys.argv[3:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""

# A fresh interpreter where the command prints its JSON and a Ctrl-C comes after (one
# that it did not meet); then ``python -m PACKAGE``.
_INTERRUPTED_AFTER_PRINTING = """
import importlib, runpy, sys
from runplan.json_errors import print_json

def main():
    print_json({"error": {"type": "Cancelled", "message": "the command's own"}})
    raise KeyboardInterrupt

importlib.import_module(sys.argv[2]).main = main
sys.argv = [sys.argv[1], *sys.argv[3:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""

COMMANDS = [
    ("runplan", "runplan.cli"),
    ("runtime_cupy", "runtime_cupy.cli.main"),
    ("runtime_sim", "runtime_sim.cli"),
]


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``argv`` with this checkout's packages first on the path, its output captured."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    return subprocess.run(
        argv, capture_output=True, text=True, env=env, timeout=timeout, check=False
    )


def _python(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-c", script, *args], 60)


@pytest.mark.parametrize(("package", "cli"), COMMANDS)
def test_ctrl_c_while_the_modules_load_is_a_quiet_cancel(package: str, cli: str) -> None:
    done = _python(_INTERRUPTED_IMPORT, package, cli)
    assert (done.returncode, done.stderr, done.stdout) == (130, "cancelled\n", "")


@pytest.mark.parametrize(("package", "cli"), COMMANDS)
def test_ctrl_c_while_the_modules_load_with_json_is_the_cancelled_object(
    package: str, cli: str
) -> None:
    """``--json``: standard output is one JSON object, the ``Cancelled`` error (it was
    empty), as once the command runs."""
    done = _python(_INTERRUPTED_IMPORT, package, cli, "run", "--json")
    assert (done.returncode, done.stderr) == (130, "cancelled\n")
    assert done.stdout.count("\n") == 1
    assert json.loads(done.stdout) == {"error": {"type": "Cancelled", "message": "cancelled"}}


@pytest.mark.parametrize(("package", "cli"), COMMANDS)
def test_ctrl_c_after_the_command_printed_its_json_prints_no_second_object(
    package: str, cli: str
) -> None:
    done = _python(_INTERRUPTED_AFTER_PRINTING, package, cli, "--json")
    assert (done.returncode, done.stderr) == (130, "cancelled\n")
    assert json.loads(done.stdout)["error"]["message"] == "the command's own"


# A fresh interpreter where the first import of the module TARGET (the modules loading)
# sends this process SIGTERM ("kill") or says "loading" on standard error and waits for
# one from outside ("wait"); then ``python -m PACKAGE``. Without a handler the signal
# ends the process (exit -15), with nothing on standard output.
_TERMINATED_IMPORT = """
import importlib.abc, os, runpy, signal, sys, time

TARGET, HOW = sys.argv[2:4]

class Terminating(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == TARGET:
            sys.meta_path.remove(self)  # once: the Cancelled object's modules may need it
            if HOW == "kill":
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                sys.stderr.write("loading\\n")
                sys.stderr.flush()
            time.sleep(60)  # a handler raises at once
            raise AssertionError("SIGTERM raised nothing")

sys.meta_path.insert(0, Terminating())
sys.argv = [sys.argv[1], *sys.argv[4:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""

# A fresh interpreter where the command's step MODULE.NAME (reading the model, opening
# the cache) sends this process SIGTERM ("kill") or says "slow" on standard error and
# waits for one from outside ("wait"); then ``python -m PACKAGE``.
_TERMINATED_IN_A_STEP = """
import importlib, os, runpy, signal, sys, time

HOW = sys.argv[3]

def step(*args, **kwargs):
    if HOW == "kill":
        os.kill(os.getpid(), signal.SIGTERM)
    else:
        sys.stderr.write("slow\\n")
        sys.stderr.flush()
    time.sleep(60)  # a handler raises at once
    raise AssertionError("SIGTERM raised nothing")

module, name = sys.argv[2].rsplit(".", 1)
setattr(importlib.import_module(module), name, step)
sys.argv = [sys.argv[1], *sys.argv[4:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""

# (package, the step SIGTERM comes in, the --json command line): every --json command
STEPS = [
    ("runplan", "runplan.cli.resolve_model", ["plan", "m.gguf", "--nodes", "a=1GiB", "--json"]),
    ("runplan", "runplan.cli.resolve_model", ["facts", "m.gguf", "--json"]),
    ("runtime_cupy", "runtime_cupy.cli.main.resolve_model",
     ["--model", "m.gguf", "--prompt-ids", "1", "--json"]),
    ("runtime_cupy", "runtime_cupy.cli.plan.resolve_model",
     ["plan", "--model", "m.gguf", "--json"]),
    ("runtime_cupy", "runtime_cupy.cli.cache.SliceCache", ["cache", "list", "--json"]),
    ("runtime_sim", "runtime_sim.cli.resolve_model",
     ["run", "--model", "m.gguf", "--prompt-ids", "1", "--json"]),
]  # fmt: skip


def _cancelled_by_sigterm(returncode: int, stdout: str, stderr: str) -> None:
    """Exit 143, standard output exactly the ``Cancelled`` object naming SIGTERM."""
    assert (returncode, stderr.splitlines()[-1:]) == (143, ["cancelled"]), stderr
    assert stdout.count("\n") == 1, stdout
    assert json.loads(stdout) == {"error": {"type": "Cancelled", "message": "cancelled by SIGTERM"}}


@pytest.mark.parametrize(("package", "cli"), COMMANDS)
def test_sigterm_while_the_modules_load_is_the_cancelled_object(package: str, cli: str) -> None:
    """SIGTERM before the command set a handler of its own is Ctrl-C too (it ended the
    process, exit -15, standard output empty)."""
    done = _python(_TERMINATED_IMPORT, package, cli, "kill", "run", "--json")
    _cancelled_by_sigterm(done.returncode, done.stdout, done.stderr)


# The first modules past the standard library that every command imports: attrs (the
# values') and NumPy (the models' and the workers'). The packages' ``__init__`` imported
# them, with the whole runtime, before ``__main__``'s first line set the handler.
FIRST_IMPORTS = ["attrs", "numpy"]


@pytest.mark.parametrize("target", FIRST_IMPORTS)
@pytest.mark.parametrize("package", [package for package, _ in COMMANDS])
def test_sigterm_as_a_command_first_imports_a_module_is_the_cancelled_object(
    package: str, target: str
) -> None:
    """The package imports nothing of its own (its names load on first use,
    ``runplan.lazy_exports``) and ``__main__`` sets the handler before any other module:
    a SIGTERM from the first third-party import on cancels the command (it ended the
    process, exit -15, standard output empty, when the package's ``__init__`` imported
    them)."""
    done = _python(_TERMINATED_IMPORT, package, target, "kill", "run", "--json")
    _cancelled_by_sigterm(done.returncode, done.stdout, done.stderr)


@pytest.mark.parametrize("package", [package for package, _ in COMMANDS])
def test_sigterm_as_c_code_imports_a_module_is_the_cancelled_object(package: str) -> None:
    """NumPy's C code imports ``datetime`` (PyCapsule_Import) and turns the exception
    the handler raised there into an ``ImportError``: the command still ends cancelled
    by SIGTERM (it ended with exit 1 and NumPy's traceback, standard output empty)."""
    done = _python(_TERMINATED_IMPORT, package, "datetime", "kill", "run", "--json")
    _cancelled_by_sigterm(done.returncode, done.stdout, done.stderr)


def test_sigterm_from_outside_while_the_runtime_loads_is_the_cancelled_object() -> None:
    """A supervisor's SIGTERM to ``python -m runtime_cupy ... --json`` as soon as it
    starts, held until the first import of NumPy (the package imported the runtime, and
    NumPy, before the handler was set: exit -15)."""
    argv = ["--model", "m.gguf", "--prompt-ids", "1", "--json"]
    _sigterm_once_it_says("loading", _TERMINATED_IMPORT, "runtime_cupy", "numpy", "wait", *argv)


@pytest.mark.parametrize(
    ("package", "step", "argv"), STEPS, ids=[f"{p} {' '.join(a[:2])}" for p, _, a in STEPS]
)
def test_sigterm_in_a_step_before_the_run_is_the_cancelled_object(
    package: str, step: str, argv: list[str]
) -> None:
    """The model being read (before a run's stages start), ``plan``, ``cache``: SIGTERM
    there ends each ``--json`` command with the ``Cancelled`` object and 143."""
    done = _python(_TERMINATED_IN_A_STEP, package, step, "kill", *argv)
    _cancelled_by_sigterm(done.returncode, done.stdout, done.stderr)


def test_sigterm_from_outside_while_a_step_waits_is_the_cancelled_object() -> None:
    """A SIGTERM another process sends (as a supervisor does) while ``python -m
    runtime_cupy plan --json`` reads the model."""
    argv = ["plan", "--model", "m.gguf", "--json"]
    step = "runtime_cupy.cli.plan.resolve_model"
    _sigterm_once_it_says("slow", _TERMINATED_IN_A_STEP, "runtime_cupy", step, "wait", *argv)


def _sigterm_once_it_says(word: str, script: str, *args: str) -> None:
    """``python -c script args``: SIGTERM from outside once it writes ``word`` on its
    standard error (it waits there), then the ``Cancelled`` object and 143."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    with subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as proc:
        assert proc.stderr is not None
        said = proc.stderr.readline()
        assert said == f"{word}\n", said
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    _cancelled_by_sigterm(proc.returncode, stdout, stderr)


# A fresh interpreter where the command prints its JSON and returns 0, and this process
# is sent the signal SIG while the interpreter exits: from a non-daemon thread it joins
# ("thread"), from an exit function ("exit function"), or as the modules are torn down
# ("teardown", where Python's handlers are gone); then ``python -m PACKAGE``.
_SIGNALLED_AS_IT_EXITS = """
import atexit, importlib, os, runpy, signal, sys, threading, time
from runplan.json_errors import print_json

SIG, WHEN = getattr(signal, sys.argv[3]), sys.argv[4]
kill, pid, sleep = os.kill, os.getpid(), time.sleep  # kept: at teardown names are gone

def signal_now():
    kill(pid, SIG)
    sleep(2)  # a handler that exits, exits at once

class AtTeardown:
    def __del__(self):
        signal_now()

def main():
    print_json({"outcome": "completed"})
    if WHEN == "thread":
        threading.Thread(target=lambda: (sleep(0.2), signal_now())).start()
    elif WHEN == "exit function":
        atexit.register(signal_now)
    return 0

if WHEN == "teardown":
    keep = AtTeardown()
importlib.import_module(sys.argv[2]).main = main
sys.argv = [sys.argv[1], *sys.argv[5:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("when", ["thread", "exit function", "teardown"])
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_once_the_command_returned_keeps_its_status(sig: str, when: str) -> None:
    """Its output written, the command's status stands: no kill by the signal's default
    action (-2, -15, during the teardown), no traceback (from the join or the exit
    function it broke into), no ``cancelled``."""
    done = _python(_SIGNALLED_AS_IT_EXITS, "runplan", "runplan.cli", sig, when, "--json")
    assert (done.returncode, done.stderr) == (0, ""), (done.returncode, done.stderr)
    assert done.stdout.count("\n") == 1
    assert json.loads(done.stdout) == {"outcome": "completed"}


# A fresh interpreter where the command prints its JSON and returns 0, and one of the
# modules' objects would take ten minutes to be finalized (a C extension's cleanup that
# hangs): the modules' teardown, where no handler of this process can run and a signal
# could only kill it or be ignored, does not come (``end_after_exit_functions``).
_A_TEARDOWN_THAT_HANGS = """
import importlib, runpy, sys, time
from runplan.json_errors import print_json

sleep = time.sleep  # kept: at teardown names are gone

class HangsAtTeardown:
    def __del__(self):
        sys.stderr.write("torn down\\n")
        sleep(600)

keep = HangsAtTeardown()

def main():
    print_json({"outcome": "completed"})
    return 0

importlib.import_module(sys.argv[2]).main = main
sys.argv = [sys.argv[1], *sys.argv[3:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def test_a_command_with_its_status_ends_without_the_modules_teardown() -> None:
    """Its status decided, the process ends after its exit functions with that status:
    a teardown that would hang (and where a SIGTERM was ignored) never starts."""
    done = _python(_A_TEARDOWN_THAT_HANGS, "runplan", "runplan.cli", "--json")
    assert (done.returncode, done.stderr) == (0, ""), (done.returncode, done.stderr)
    assert json.loads(done.stdout) == {"outcome": "completed"}


# A fresh interpreter that prints a line (not flushed) and exits with status 3 through
# ``exit_with``, where a SIGTERM's ``Interrupted`` is raised as it sets its handlers (the
# command's handler still in place: Python runs it inside ``signal.getsignal``).
_SIGNALLED_AS_THE_HANDLERS_ARE_SET = """
import signal, sys
from runplan.interrupted import Interrupted
from runplan.late_signals import exit_with

getsignal = signal.getsignal

def interrupted_once(signum):
    signal.getsignal = getsignal
    raise Interrupted("SIGTERM")

signal.getsignal = interrupted_once
sys.stdout.write("the command's output\\n")
exit_with(3)
"""


def test_a_signal_as_the_late_handlers_are_set_keeps_the_status() -> None:
    done = _python(_SIGNALLED_AS_THE_HANDLERS_ARE_SET)
    assert (done.returncode, done.stdout, done.stderr) == (3, "the command's output\n", "")


# A fresh interpreter where the optional extras' packages cannot be imported, as in a
# venv of the default dependencies only; then every command's --help.
_WITHOUT_EXTRAS = """
import importlib.abc, runpy, sys

EXTRAS = ("prometheus_client", "starlette", "uvicorn", "ray", "cupy", "hypothesis", "pytest")

class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in EXTRAS:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)

sys.meta_path.insert(0, Missing())
for name in list(sys.modules):
    if name.split(".")[0] in EXTRAS:
        del sys.modules[name]
import runtime_cupy.process.stage_process  # what a stage process imports
from runtime_cupy import generate, generate_batch  # the library, as the README shows
sys.argv = [sys.argv[1], "--help"]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("package", ["runplan", "runtime_cupy", "runtime_sim"])
def test_the_commands_run_without_the_extras(package: str) -> None:
    """``pip install gguf-pipeline`` (no ``serve`` extra): ``python -m runtime_cupy``
    and the library import (they once needed ``prometheus_client``, ``serve``'s, through
    the recovery module, so a Ray host of ``[ray]`` could not start a stage)."""
    done = _python(_WITHOUT_EXTRAS, package)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


@pytest.mark.parametrize(("package", "_module"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_version_names_the_installed_distribution(package: str, _module: str) -> None:
    """``--version`` prints the installed distribution's version (what pip reads) on
    standard output and exits 0, without asking for the command's required words."""
    from importlib import metadata

    done = subprocess.run(
        [sys.executable, "-m", package, "--version"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        f"python -m {package} (gguf-pipeline {metadata.version('gguf-pipeline')})"
    )


@pytest.mark.parametrize(
    "command",
    [
        ["runplan", "facts", "--json"],
        ["runtime_sim", "explore", "--rules"],
        ["runtime_cupy", "plan", "--json"],
        ["runplan.fsm", "--help"],
        # text through rich (``runplan.terminal.CommandConsole``): rich's own console
        # raised SystemExit(1) where its reader had gone
        ["runplan", "facts"],
        ["runtime_cupy", "plan"],
        ["runtime_sim", "explore", "--seeds", "1"],
    ],
    ids=" ".join,
)
def test_a_reader_that_went_away_ends_the_command_quietly(command: list[str]) -> None:
    """Standard output's reader gone before the command writes (``| head -c0``, a pager
    quit): exit 141, as a shell reports a process SIGPIPE ended, and no
    ``BrokenPipeError`` traceback (there were one or two, exit 1), whether the command
    writes with ``print`` or with rich (a table, a line)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    proc = subprocess.Popen(
        [sys.executable, "-m", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert proc.stdout is not None
    proc.stdout.close()  # before the interpreter has even started the command
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141, err
    assert "Traceback" not in err, err


# (package, a command line that writes standard output): --version, --help and a --json
# command of each package, and the diagrams' --help
FULL_OUTPUT = [
    ("runplan", ["--version"]),
    ("runplan", ["--help"]),
    ("runplan", ["facts", "smollm2-135m", "--json"]),
    ("runtime_cupy", ["--version"]),
    ("runtime_cupy", ["plan", "--model", "smollm2-135m", "--json"]),
    ("runtime_sim", ["--version"]),
    ("runplan.fsm", ["--help"]),
]


@pytest.mark.parametrize(("package", "argv"), FULL_OUTPUT)
def test_standard_output_on_a_full_device_is_one_error_line(package: str, argv: list[str]) -> None:
    """Standard output on ``/dev/full`` (a full disk): exit 1 and one line naming it on
    standard error (it was a traceback, or for ``--version`` exit 0 and the text lost:
    argparse drops the write's error)."""
    if not os.path.exists("/dev/full"):
        pytest.skip("this host has no /dev/full")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", package, *argv],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
    assert (done.returncode, done.stderr) == (
        1,
        "error: cannot write standard output: No space left on device\n",
    )


# A fresh interpreter where the command fails with an I/O error of a device that is not
# standard output (a terminal gone under standard input); then ``python -m PACKAGE``.
_DEVICE_GONE = """
import errno, importlib, runpy, sys

def main():
    raise OSError(errno.EIO, "Input/output error")

importlib.import_module(sys.argv[2]).main = main
sys.argv = [sys.argv[1], *sys.argv[3:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize(("package", "cli"), COMMANDS)
def test_an_io_error_elsewhere_is_not_named_for_standard_output(package: str, cli: str) -> None:
    """An ``EIO`` of standard input's terminal, gone: one line, exit 1, not blamed on
    standard output, which works (it said "cannot write standard output")."""
    done = _python(_DEVICE_GONE, package, cli)
    assert (done.returncode, done.stderr, done.stdout) == (1, "error: Input/output error\n", "")


def _closing(redirect: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m ARGV`` with one standard descriptor closed by the shell (``>&-``)."""
    return _run(["sh", "-c", f'exec "$0" -m "$@" {redirect}', sys.executable, *argv], 120)


@pytest.mark.parametrize(("package", "_module"), COMMANDS)
def test_a_closed_standard_output_is_one_error_line(package: str, _module: str) -> None:
    """Standard output closed (``>&-``): one line, exit 1, before the command starts (an
    ``AttributeError`` traceback: Python's ``sys.stdout`` is then ``None``)."""
    done = _closing(">&-", package, "--version")
    assert (done.returncode, done.stderr) == (1, "error: standard output is closed\n")


def test_a_closed_standard_input_or_error_is_dev_null() -> None:
    """Standard input closed (``<&-``): read as empty, the command's own error; standard
    error closed (``2>&-``): the command's status, its error lost (both were an
    ``AttributeError`` traceback)."""
    done = _closing("<&-", "runplan", "check", "-", "--json")
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout)["error"]["type"] == "UnreadableInput"
    assert "Traceback" not in done.stderr
    done = _closing("2>&-", "runplan", "facts", "/nonexistent/model.gguf")
    assert (done.returncode, done.stdout) == (1, ""), done


@pytest.mark.parametrize(
    ("cli", "argv", "needle"),
    [
        ("runtime_cupy.cli.main", ["serv", "--port", "8080"],
         "unknown command 'serv' (commands: plan, serve, chat, cache)"),
        ("runtime_sim.cli", ["rnu", "--prompt", "hi"], "invalid choice: 'rnu'"),
        ("runplan.cli", ["fact", "x"], "invalid choice: 'fact'"),
    ],
)  # fmt: skip
def test_a_mistyped_command_is_named(
    cli: str, argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A first argument that is no command and no flag: exit 2, one line naming it
    (``runtime_cupy serv`` said that one of --prompt, --prompt-ids, --prompts-file is
    required)."""
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(cli).main(argv)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines


# A fresh interpreter whose address space is limited to what it holds now and 64 MiB
# more, and where the command's ``main`` asks for 1 GiB (a tokenizer's vocabulary read
# under a small ``ulimit -v`` raised MemoryError so); then ``python -m PACKAGE``.
_OUT_OF_MEMORY = """
import importlib, resource, runpy, sys

def main():
    return len(bytearray(1 << 30))

with open("/proc/self/statm") as f:
    held = int(f.read().split()[0]) * resource.getpagesize()
importlib.import_module(sys.argv[2]).main = main
limit = held + (64 << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
print(limit, file=sys.stderr, flush=True)
sys.argv = [sys.argv[1], *sys.argv[3:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["text", "json"])
@pytest.mark.parametrize(("package", "cli"), COMMANDS)
def test_a_command_out_of_memory_says_so_naming_the_limit(
    package: str, cli: str, json_flag: list[str]
) -> None:
    """A ``MemoryError`` no command met: one line naming the address-space limit and
    exit 1 (the host fell short, as for a model that cannot be mapped), with ``--json``
    the ``OutOfMemory`` object; it was a ``MemoryError`` traceback and, with ``--json``,
    nothing on standard output."""
    if not Path("/proc/self/statm").exists():
        pytest.skip("needs /proc/self/statm to size the address-space limit")
    done = _python(_OUT_OF_MEMORY, package, cli, *json_flag)
    limit, _, rest = done.stderr.partition("\n")
    message = (
        "this process ran out of memory; the address-space limit (RLIMIT_AS, ulimit -v) "
        f"is {limit} bytes"
    )
    assert (done.returncode, rest) == (1, f"error: {message}\n"), done.stderr
    if json_flag:
        assert json.loads(done.stdout) == {"error": {"type": "OutOfMemory", "message": message}}
    else:
        assert done.stdout == ""
