"""``python -m runplan.fsm``, as ``python -m runplan`` (``runplan/__main__.py`` says how):
the diagrams' command (``runplan.fsm.diagrams``) run through ``run_command``, which ends
a full or closed standard output as every command does."""

from runplan.command_main import run_command

run_command("runplan.fsm.diagrams")
