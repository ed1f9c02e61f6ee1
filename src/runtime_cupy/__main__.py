"""``python -m runtime_cupy``, as ``python -m runplan`` (``runplan/__main__.py`` says how): SIGTERM
is Ctrl-C from the first line on, and a Ctrl-C or SIGTERM while the command's modules
load ends it as a cancelled command (``runplan.json_errors.cancelled_exit``)."""

import sys

from runplan.interrupted import raised_before, sigterm_as_ctrl_c

sigterm_as_ctrl_c()  # first: SIGTERM from here on cancels the command as Ctrl-C does
try:
    from runtime_cupy.cli.main import main

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
