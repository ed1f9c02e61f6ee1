"""How an edge moves bytes between processes: the port (``base``: ``EdgeMedium``,
``ProcessRing``, ``ProcessEdges``, ``Rendezvous``), shared memory on one host (``shm``),
TCP between hosts (``tcp``, with its ``handshake``), and the choice between them
(``choice``)."""
