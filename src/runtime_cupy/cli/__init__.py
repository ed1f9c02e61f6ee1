"""``python -m runtime_cupy``: a run through stage processes (``main``, which also
dispatches the subcommands), ``plan``, ``serve`` and ``chat``."""
