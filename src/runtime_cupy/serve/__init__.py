"""Serving a model from warm stages: ``chain`` (the stages started and bound once,
one run per request), the OpenAI-compatible HTTP API (``python -m runtime_cupy
serve``) and the terminal chat (``python -m runtime_cupy chat``).

Only ``chain`` is imported here: the HTTP parts need the ``serve`` extra (Starlette,
uvicorn, prometheus-client) and are imported when asked for."""

from runtime_cupy.serve.chain import ChainError, WarmChain, WarmResult

__all__ = ["ChainError", "WarmChain", "WarmResult"]
