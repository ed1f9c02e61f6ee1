"""runtime_cupy: not built yet (see the open issues); the package exists so the layout is in place."""
