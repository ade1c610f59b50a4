"""What infermux is expected to score, per backend kind: the checks that are n/a (each a
capability the backend declares it lacks) and the known gaps (real bugs, listed in
docs/conformance.md, each to be removed here when fixed, which this file's tests force)."""

from __future__ import annotations

#: Real contract bugs still open: the check name and why it fails on every backend.
KNOWN_GAPS: dict[str, str] = {}

#: Declared lacks per backend kind (SmolLM2 returns no reasoning field on any backend).
NOT_APPLICABLE: dict[str, set[str]] = {
    "mock": {
        "chat.reasoning", "chat.cached_tokens", "embeddings.float", "embeddings.base64",
        "structured.json_object", "structured.json_schema",
        "tools.required", "tools.named", "tools.parallel_off", "tools.parallel", "tools.stream",
    },
    "core_engine": {"chat.reasoning"},
    "llamacpp": {"chat.reasoning"},
    "mlx": {"chat.reasoning", "completions.echo", "embeddings.float", "embeddings.base64"},
    # A remote has no tokenizer here, so count_tokens is refused.
    "openai": {"chat.reasoning", "anthropic.count_tokens"},
}
