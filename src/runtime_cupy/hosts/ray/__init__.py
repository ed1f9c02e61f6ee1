"""Stages on the hosts of a Ray cluster: Ray places and watches them, TCP edges (shared
memory within a machine) carry their bytes.

- ``cluster``: the node pool (live hosts, memory and GPUs as Ray reports them, node ids
  a person can read) and which host each stage goes to;
- ``session``: this process as the cluster's driver (connect, the queries);
- ``host``: ``RayHost``, the host port over Ray; ``stage_handle``: a stage it started,
  as the launcher sees it; ``supervisor``: the actor of one stage;
  ``control_link``: its control connection; ``rendezvous``: Ray's key-value store as the
  edges' rendezvous; ``stage_entry``: the stage process on a cluster host.

Nothing here imports Ray at import time: a stage process never loads it.
"""
