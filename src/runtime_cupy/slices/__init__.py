"""Slices of a model that travel: a stage on a host without the model's file gets
exactly its slice from the orchestrator's host, into that host's cache.

- ``server``: the orchestrator's slice server (started by a host whose stages live on
  other machines: ``hosts.ray``).
- ``fetch``: a stage's side (the cache, the file at the plan's path, or a transfer).
- ``worker``: the stage's worker, binding what ``fetch`` resolves.
- ``protocol``: the wire (the TCP edges' handshake, sealed frames, the tensor bytes
  raw or, with ``--encrypt-edges``, in sealed chunks).
- ``cache``: a host's cache of slices; ``digests``: what hashing found, kept.
- ``progress``: bars, log lines and figures (``python -m runtime_cupy cache`` is
  ``cli.cache``).
"""
