"""The NumPy reference worker (``worker``) and its llama2.c-style model (``model``)."""
