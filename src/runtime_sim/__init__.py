"""runtime_sim: not built yet (see the open issues).

The package exists so that the layout is in place."""
