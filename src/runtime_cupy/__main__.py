"""``python -m runtime_cupy``. A Ctrl-C while the command's modules load (or one that no
command met) ends it as a cancelled command (``runplan.json_errors.cancelled_exit``):
``cancelled`` on standard error, exit 130 (143 for SIGTERM raised as
``runtime_core.interrupt.Interrupted``), and with ``--json`` the ``Cancelled`` object on
standard output unless the command printed its own. The handler's module is imported
before the command's: ``runplan``'s package, which it needs, is loaded by then (the
package's ``__init__`` imports it). One while that ``__init__`` imports is beyond its
reach: a traceback, no JSON."""

import sys

from runplan.json_errors import cancelled_exit

try:
    from runtime_cupy.cli.main import main

    status = main()
except KeyboardInterrupt as exc:  # while the modules load (or past the command's own care)
    status = cancelled_exit(exc)
sys.exit(status)
