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
name's module is imported on first use), ``runplan.command_main``,
``runplan.interrupted`` and ``runplan.late_signals``, standard library all four: the
first few hundredths of a second of the process, the interpreter's start included,
where the signal's default action ends it (and a Ctrl-C prints Python's traceback).
The ``Cancelled`` object's module is imported when it is needed, so that nothing else
comes before the handler.

Once the command has its exit status, its output written, a Ctrl-C or SIGTERM is too
late to cancel anything and leaves that status as it is (``runplan.late_signals``).
``runplan.command_main.run_command`` is this entry, shared by the three packages (what
else it ends without a traceback: there)."""

from runplan.command_main import run_command

run_command("runplan.cli")
