"""The process runtime: the orchestrator's event loop (``launcher``), a stage's
(``stage_process``, also the local stage process's entry), the authenticated control
channel, and what their loops share: the poll (``poller``), non-blocking streams,
deadlines, keys, run names and Chrome trace events."""
