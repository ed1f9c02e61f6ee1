"""How an edge moves bytes between processes: shared memory on one host (``shm``)."""
