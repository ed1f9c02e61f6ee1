"""``python -m runtime_sim``, as ``python -m runplan`` (``runplan/__main__.py`` says how): SIGTERM
is Ctrl-C from the first line on, and a Ctrl-C or SIGTERM while the command's modules
load ends it as a cancelled command (``runplan.json_errors.cancelled_exit``)."""

from runplan.command_main import run_command

run_command("runtime_sim.cli")
