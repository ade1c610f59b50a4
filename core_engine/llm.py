"""Offline batch generation: ``LLM(model_path).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from core_engine.config import EngineConfig
from core_engine.llm_engine import LLMEngine
from core_engine.output import GenerationOutput
from core_engine.policy import EnginePolicies
from core_engine.sampling_params import SamplingParams

__all__ = ["LLM"]

Prompt = str | Sequence[int]


class LLM:
    """A model loaded into an engine for offline use (all prompts batched together).

    ``LLM("model.gguf", kv_cache_memory_bytes=2**28).generate(["Hello"], SamplingParams())``;
    keyword arguments are :class:`~core_engine.config.EngineConfig` fields; ``policies`` the
    engine consults (default: :class:`~core_engine.policy.EnginePolicies`).
    """

    def __init__(self, model_path: str, *, policies: EnginePolicies | None = None, **config: Any) -> None:
        self.engine = LLMEngine.from_config(EngineConfig(model_path=str(model_path), **config), policies=policies)
        self._counter = 0

    @property
    def tokenizer(self):  # -> Tokenizer
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[GenerationOutput]:
        """Generate for every prompt (a string, token ids, or a list of either), in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompt_list: list[Prompt] = [prompts]  # type: ignore[list-item]
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(f"{len(param_list)} SamplingParams for {len(prompt_list)} prompts")
        results: dict[str, GenerationOutput] = {}
        order: list[str] = []
        # Validate everything before queueing anything, so a bad prompt leaves no orphans.
        requests = []
        for prompt, p in zip(prompt_list, param_list, strict=True):
            self._counter += 1
            req_id = f"offline-{self._counter}"
            requests.append(self.engine.make_request(req_id, prompt, p))
            order.append(req_id)
            results[req_id] = GenerationOutput(
                req_id=req_id,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=list(requests[-1].prompt_token_ids),
                text="",
                token_ids=[],
                finish_reason=None,
                logprobs=[] if p.logprobs is not None else None,
            )
        for request in requests:
            self.engine.add_request(request.req_id, request)
        bar = tqdm(total=len(requests), desc="generating", unit="req", disable=not use_tqdm)
        with bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    res = results[out.req_id]
                    res.text += out.new_text
                    res.token_ids.extend(out.new_token_ids)
                    if out.logprobs is not None and res.logprobs is not None:
                        res.logprobs.extend(out.logprobs)
                    if out.prompt_logprobs is not None:
                        res.prompt_logprobs = list(out.prompt_logprobs)
                    if out.finished:
                        res.finish_reason = out.finish_reason
                        res.stop_reason = out.stop_reason
                        res.num_cached_tokens = out.num_cached_tokens
                        res.metrics = out.metrics
                        res.speculation = out.speculation
                        bar.update(1)
        return [results[r] for r in order]
