"""How an edge moves bytes between processes: the port (``port``: ``EdgeMedium``,
``ProcessRing``, ``Rendezvous``), a chain's links over them (``links``: one per hop),
shared memory on one host (``shm``),
TCP between hosts (``tcp``: the medium; ``tcp_consumer``, ``tcp_producer`` and
``tcp_frames``: its two ends and what they share; ``tcp_door``: the consumer's port and
the strangers on it; ``handshake``), and the choice between them (``choice``)."""
