"""Where a stage lives: the host port (``base.StageHost``) and its implementations,
``local.LocalProcessHost`` (one OS process per stage on this machine)."""
