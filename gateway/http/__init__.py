"""The HTTP edge: the ASGI generation endpoint and the response it streams, the checks a
request passes before any of its bytes are decoded (header size, open mode's ``Host`` /
``Origin``, API key, ``Content-Type``, raw body), request ids, the OpenAI error envelope,
SSE framing of errors, the OpenAPI document and the drain.

Imports run one way: :mod:`gateway.http` -> :mod:`gateway.openai` -> :mod:`gateway.serving`
(tests/test_import_structure.py)."""
