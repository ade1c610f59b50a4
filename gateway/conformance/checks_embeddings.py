"""Embeddings: the list object, one embedding per input, float and base64 encodings.

Written from https://platform.openai.com/docs/api-reference/embeddings (create, the embedding
object). Not applicable where the model declares it computes none (a 400
``unsupported_parameter``, or no route).
"""

from __future__ import annotations

import base64
import struct

from gateway.conformance.expect import expect, expect_type
from gateway.conformance.runner import Probe, check

REF = "https://platform.openai.com/docs/api-reference/embeddings"
EMBEDDINGS = "/v1/embeddings"
INPUTS = ["The sea is calm tonight.", "A dragon learns to fly."]


@check("embeddings.float", "openai", f"{REF}/object (object \"list\", data[].object \"embedding\"/index/embedding, usage)")
def embeddings_float(probe: Probe) -> None:
    body = {"model": probe.model, "input": INPUTS, "encoding_format": "float"}
    exchange = probe.require_ok(probe.post(EMBEDDINGS, body))
    data = exchange.json()
    expect(data.get("object") == "list", "object must be \"list\"", exchange)
    expect_type(data.get("model"), str, "model", exchange)
    items = data.get("data")
    expect(isinstance(items, list) and len(items) == len(INPUTS), "one embedding per input", exchange)
    sizes = set()
    for i, item in enumerate(items):
        expect(item.get("object") == "embedding", f"data[{i}].object must be \"embedding\"", exchange)
        expect(item.get("index") == i, f"data[{i}].index must be {i}", exchange)
        vector = item.get("embedding")
        expect(isinstance(vector, list) and len(vector) > 0 and all(isinstance(x, float | int) for x in vector), f"data[{i}].embedding must be a list of numbers", exchange)
        sizes.add(len(vector))
    expect(len(sizes) == 1, "every embedding has the model's dimension", exchange, offending=sorted(sizes))
    usage = data.get("usage") or {}
    expect_type(usage.get("prompt_tokens"), int, "usage.prompt_tokens", exchange)
    expect(usage.get("total_tokens") == usage["prompt_tokens"], "usage.total_tokens must equal prompt_tokens", exchange, offending=usage)


@check("embeddings.base64", "openai", f"{REF}/create#embeddings-create-encoding_format (base64: little-endian float32)")
def embeddings_base64(probe: Probe) -> None:
    floats = probe.require_ok(probe.post(EMBEDDINGS, {"model": probe.model, "input": INPUTS[0], "encoding_format": "float"}))
    exchange = probe.require_ok(probe.post(EMBEDDINGS, {"model": probe.model, "input": INPUTS[0], "encoding_format": "base64"}))
    vector = floats.json()["data"][0]["embedding"]
    encoded = exchange.json()["data"][0]["embedding"]
    expect_type(encoded, str, "data[0].embedding", exchange)
    raw = base64.b64decode(encoded)
    expect(len(raw) == 4 * len(vector), "the base64 embedding must hold as many float32 as the float one", exchange)
    decoded = struct.unpack(f"<{len(vector)}f", raw)
    expect(all(abs(a - b) <= 1e-4 + 1e-3 * abs(b) for a, b in zip(decoded, vector, strict=True)), "the base64 embedding must decode to the float one", exchange)
