"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``), translated
onto the same generation path as chat completions: router, plugins, limits, traces, ledger.
Its wire types never leave this package."""
