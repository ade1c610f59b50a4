"""Structured outputs: constrain a request's tokens to a JSON schema, a regex, a list of
choices or a grammar, with llguidance.

* :mod:`~core_engine.structured.spec` - what a request asks for (:class:`StructuredOutput`,
  vLLM's ``structured_outputs`` fields);
* :mod:`~core_engine.structured.compiler` - the grammar compiled once per distinct
  constraint (cached by hash), within size and time limits; a matcher per request;
* :mod:`~core_engine.structured.masks` - the batch's token masks, computed on llguidance's
  threads while the forward pass runs, and applied to the logits before sampling.

The engine compiles in :meth:`~core_engine.llm_engine.LLMEngine.make_request` (the caller's
thread, never the engine step), the sampler applies the masks to every constrained row of a
batch, and each sampled token advances its request's matcher. A finished grammar allows
only the end-of-sequence tokens, so a constrained output always parses unless ``max_tokens``
cuts it (``finish_reason = "length"``).
"""

from core_engine.structured.compiler import GrammarCompiler
from core_engine.structured.spec import StructuredOutput

__all__ = ["GrammarCompiler", "StructuredOutput"]
