"""``python -m runplan``. A Ctrl-C while the command's modules load (or one that no
command met) ends it as a cancelled command (``runplan.json_errors.cancelled_exit``):
``cancelled`` on standard error, exit 130 (143 for SIGTERM raised as
``runplan.interrupted.Interrupted``), and with ``--json`` the ``Cancelled`` object on
standard output unless the command printed its own. The handler's module is imported
before the command's: ``runplan``'s package, which it needs, is loaded by then (the
package's ``__init__`` imports it). One while that ``__init__`` imports is beyond its
reach: a traceback, no JSON.

SIGTERM is Ctrl-C from the first line on (``runplan.interrupted.sigterm_as_ctrl_c``):
whenever it comes (the modules loading, the model being read, any command), the command
ends as cancelled, exit 143, ``Cancelled`` by SIGTERM with ``--json``; a command's own
handlers take it while they hold. Before that line (the package's ``__init__``), the
signal's default action ends the process."""

import sys

from runplan.interrupted import sigterm_as_ctrl_c
from runplan.json_errors import cancelled_exit

sigterm_as_ctrl_c()  # first: SIGTERM from here on cancels the command as Ctrl-C does
try:
    from runplan.cli import main

    status = main()
except KeyboardInterrupt as exc:  # while the modules load (or past the command's own care)
    status = cancelled_exit(exc)
sys.exit(status)
