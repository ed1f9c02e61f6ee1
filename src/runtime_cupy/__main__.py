"""``python -m runtime_cupy``. A Ctrl-C while the command's modules load (or one that no
command met) ends it as a cancelled command: ``cancelled`` on standard error, exit 130
(143 for SIGTERM raised as ``runtime_core.interrupt.Interrupted``), and with ``--json``
the ``Cancelled`` object on standard output unless the command printed its own. The
handler uses the standard library alone: the modules may not be loaded. One while the
package's own ``__init__`` imports (before this module runs) is beyond its reach: a
traceback, no JSON."""

import sys

try:
    from runtime_cupy.cli.main import main

    status = main()
except KeyboardInterrupt as exc:  # while the modules load (or past the command's own care)
    signal_name = getattr(exc, "signal_name", None)  # SIGTERM: runtime_core.interrupt
    json_errors = sys.modules.get("runplan.json_errors")
    if "--json" in sys.argv[1:] and not (json_errors and json_errors.printed()):
        message = "cancelled" + (f" by {signal_name}" if signal_name else "")
        sys.stdout.write(f'{{"error": {{"message": "{message}", "type": "Cancelled"}}}}\n')
        sys.stdout.flush()
    sys.stderr.write("cancelled\n")
    status = 143 if signal_name == "SIGTERM" else 130
sys.exit(status)
