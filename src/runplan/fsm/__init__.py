"""The sans-I/O state machines of a run: ``orchestrator`` (§5) and ``stage`` (§6).

Each machine's module holds its ``step(machine, event) -> (machine, actions)``, which
never raises and never reads a clock, and its transition table as data (``TABLE``), and
re-exports the machine's whole vocabulary: its states, events and actions
(``*_events``, ``*_actions``), its value (``*_machine``), its checks and handlers
(``stage_checks``, ``*_handlers``). ``python -m runplan.fsm`` writes their Mermaid
diagrams to ``docs/``.
"""
