"""``python -m runplan``. A Ctrl-C while the command's modules load (or one that no
command met) ends it as a cancelled command (``runplan.json_errors.cancelled_exit``):
``cancelled`` on standard error, exit 130 (143 for SIGTERM raised as
``runplan.interrupted.Interrupted``), and with ``--json`` the ``Cancelled`` object on
standard output unless the command printed its own.

SIGTERM is Ctrl-C from the first line on (``runplan.interrupted.sigterm_as_ctrl_c``):
whenever it comes (the modules loading, the model being read, any command), the command
ends as cancelled, exit 143, ``Cancelled`` by SIGTERM with ``--json``; a command's own
handlers take it while they hold. Before that line Python has imported only the package
(its ``__init__`` imports no module of its own but ``runplan.lazy_exports``; each public
name's module is imported on first use) and ``runplan.interrupted``, standard library
both: the first few hundredths of a second of the process, the interpreter's start
included, where the signal's default action ends it (and a Ctrl-C prints Python's
traceback). The ``Cancelled`` object's module is imported when it is needed, so that
nothing else comes before the handler."""

import sys

from runplan.interrupted import raised_before, sigterm_as_ctrl_c

sigterm_as_ctrl_c()  # first: SIGTERM from here on cancels the command as Ctrl-C does
try:
    from runplan.cli import main

    status = main()
except KeyboardInterrupt as exc:  # while the modules load (or past the command's own care)
    from runplan.json_errors import cancelled_exit

    status = cancelled_exit(exc)
except BrokenPipeError:  # standard output's reader went away (``| head``)
    from runplan.json_errors import reader_gone_exit

    status = reader_gone_exit()
except Exception:  # after a SIGTERM that C code turned into another error: cancelled
    if (interrupted := raised_before()) is None:
        raise
    from runplan.json_errors import cancelled_exit

    status = cancelled_exit(interrupted)
sys.exit(status)
