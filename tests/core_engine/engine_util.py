"""Helpers shared by the engine-level tests: building engines and a reference decoder."""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch

from core_engine.attention import ContiguousAttention
from core_engine.config import EngineConfig
from core_engine.llm_engine import LLMEngine
from core_engine.output import RequestOutput
from core_engine.sampling_params import SamplingParams


def make_engine(model_path: str | Path, **overrides: object) -> LLMEngine:
    # One thread: on a shared 2-core machine two OpenMP threads wait on each other (10-50x slower).
    # Dense fp32 weights: these tests compare token for token two ways of computing the same
    # thing (paged vs contiguous attention, speculative vs plain decoding), exact in fp32; the
    # block formats' 8-bit activations round, so a 1e-7 difference in an attention sum can flip
    # a near-tie there. The default (int4) path has its own tests (test_weight_format.py) and
    # serves every gateway test.
    options: dict[str, object] = {
        "dtype": "float32", "weight_format": "dense", "kv_cache_memory_bytes": 64 * 2**20, "num_threads": 1,
    }
    options.update(overrides)
    return LLMEngine.from_config(EngineConfig(model_path=str(model_path), **options))  # type: ignore[arg-type]


def reference_greedy(engine: LLMEngine, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens from the model's own one-sequence contiguous-cache attention."""
    model = engine.model_runner.model
    attn = ContiguousAttention(model.config.num_layers)
    out: list[int] = []
    with torch.inference_mode():
        ids = torch.tensor(prompt_ids)
        logits = model(ids, torch.arange(len(prompt_ids)), attn, logits_indices=torch.tensor([len(prompt_ids) - 1]))
        for i in range(max_tokens):
            token = int(logits[-1].argmax())
            out.append(token)
            logits = model(torch.tensor([token]), torch.tensor([len(prompt_ids) + i]), attn)
    return out


def run_all(
    engine: LLMEngine, prompts: dict[str, str | list[int]], params: SamplingParams | dict[str, SamplingParams]
) -> dict[str, dict[str, object]]:
    """Add every prompt, step until done; per request: token ids, text, final output."""
    results: dict[str, dict[str, object]] = {}
    for req_id, prompt in prompts.items():
        p = params[req_id] if isinstance(params, dict) else params
        engine.add_request(req_id, prompt, p)
        results[req_id] = {"token_ids": [], "text": "", "outputs": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            collect(results[out.req_id], out)
    return results


def collect(result: dict[str, object], out: RequestOutput) -> None:
    result["token_ids"] = [*result["token_ids"], *out.new_token_ids]  # type: ignore[misc]
    result["text"] = str(result["text"]) + out.new_text
    result["outputs"] = [*result["outputs"], out]  # type: ignore[misc]
    if out.finished:
        result["final"] = out


def engine_like(engine: LLMEngine, **overrides: object) -> LLMEngine:
    """A second engine over the same loaded weights with a different configuration."""
    config = msgspec.structs.replace(engine.config, **overrides)
    return LLMEngine(config, engine.model_runner.model, engine.tokenizer, dtype=engine.model_runner.kv_cache.dtype)
