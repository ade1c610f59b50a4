"""One request's life once it is a :class:`~backends.base.GenerationRequest`: admission
(rate limits, concurrency), routing and circuit breakers, resuming a broken stream on another
backend, running the choices with their plugin hooks, and the summary plugins get at the end.

No Litestar, no ASGI and no wire types here: it imports neither :mod:`gateway.http` nor
:mod:`gateway.openai` (tests/test_import_structure.py)."""
