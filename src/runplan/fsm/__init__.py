"""The sans-I/O state machines of a run: ``orchestrator`` (§5) and ``stage`` (§6).

Each module holds a state enum, event and action types, and its transition table as
data (``TABLE``); ``step(machine, event) -> (machine, actions)`` never raises and never
reads a clock. ``python -m runplan.fsm`` writes their Mermaid diagrams to ``docs/``.
"""
