"""Constraints compiled to llguidance matchers: once per distinct constraint, within limits.

A constraint is turned into llguidance's grammar (JSON Schema, regex and Lark go through
llguidance's own compilers; a list of choices becomes a Lark alternation; GBNF is
translated by ``llguidance.gbnf_to_lark``), then into an ``LLMatcher`` over the model's
vocabulary. The first matcher of each constraint is kept pristine in an LRU cache (keyed by
the constraint's canonical text); every request gets a ``deep_copy`` of it, so a schema sent
again costs a copy, not a compile.

Limits, so that no request can stall the engine or its caller: the constraint's size
(``max_bytes``), llguidance's parser limits (lexer fuel, grammar size, Earley items per
step), and a wall-clock cap on compiling (``compile_timeout_s``; llguidance drops the GIL
while it compiles, so the wait is a thread's). A constraint that llguidance rejects or that
breaks a limit is an ``InvalidParamError`` naming the request field it came from.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

from core_engine.errors import InvalidParamError
from core_engine.structured.spec import StructuredOutput

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = ["MASK_SLICES", "GrammarCompiler", "llguidance_tokenizer"]

_JSON_STRING_CHAR = r'[^"\\\x00-\x1F\x7F]'
#: llguidance's "slices": token sets whose trie walk is skipped when the lexer allows all of
#: them. llguidance's own JSON slices cut string tokens at 10 and 30 characters, so inside a
#: string with fewer than 10 characters left before its ``maxLength`` the whole vocabulary is
#: walked. Bands of one character up to 12 let the mask skip every token that fits the room
#: left; replaying the test schemas' outputs this cut the per-token mask p90 from 0.29 to
#: 0.09 ms (docs/benchmarks.md, "Structured outputs"). What no slice can skip is the walk of
#: the tokens longer than the room left, to that depth: the p99.
MASK_SLICES: tuple[str, ...] = tuple(
    f"{_JSON_STRING_CHAR}{{1,{n}}}" for n in (*range(1, 13), 16, 20, 30)
) + (f"{_JSON_STRING_CHAR}+",)

logger = logging.getLogger(__name__)


class _TokenizerView:
    """What ``llguidance.TokenizerWrapper`` reads of a tokenizer: every token's bytes
    (control tokens prefixed with 0xFF, llguidance's mark for "special"), EOS/BOS, and
    text -> ids."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        special: list[int] = []
        tokens: list[bytes] = []
        for token_id in range(vocab_size):
            if token_id >= tokenizer.vocab_size:
                tokens.append(b"")  # embedding rows past the vocabulary: never valid
                continue
            piece = tokenizer.token_to_bytes(token_id, skip_special=False)
            if tokenizer.is_special(token_id):
                special.append(token_id)
                piece = b"\xff" + piece
            tokens.append(piece)
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")  # llguidance probes for bytes input, then uses str
        return self._tokenizer.encode(text, add_special=False)


def llguidance_tokenizer(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """An ``llguidance.LLTokenizer`` over the engine's tokenizer (seconds for a large vocabulary)."""
    import llguidance

    wrapper = llguidance.TokenizerWrapper(_TokenizerView(tokenizer, vocab_size))
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=sorted(stop_token_ids) or None)


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _json_defaults(spec: StructuredOutput) -> JsonCompileOptions | None:
    """llguidance's JSON options: by default any whitespace between tokens (as JSON allows);
    ``disable_any_whitespace``: none outside strings."""
    return {"whitespace_flexible": False} if spec.disable_any_whitespace else None


class GrammarCompiler:
    """Matchers for one vocabulary (see the module docstring). Thread-safe."""

    def __init__(
        self, make_tokenizer: Callable[[], Any], *,
        max_bytes: int = 64 * 1024, compile_timeout_s: float = 2.0, cache_size: int = 256,
    ) -> None:
        """``make_tokenizer`` builds the ``llguidance.LLTokenizer`` of the vocabulary (called
        once, on the first constraint): :func:`llguidance_tokenizer` for the core engine's
        tokenizer, ``llguidance.llamacpp.lltokenizer_from_vocab`` for llama.cpp's."""
        self._make_tokenizer = make_tokenizer
        self.max_bytes = max_bytes
        self.compile_timeout_s = compile_timeout_s
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._lltokenizer: Any = None
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
        #: Seconds of the last compiles (cache misses), for the benchmark and stats.
        self.compile_seconds: deque[float] = deque(maxlen=1024)
        self.num_cache_hits = 0

    def lltokenizer(self) -> Any:
        with self._lock:
            if self._lltokenizer is None:
                started = time.perf_counter()
                self._lltokenizer = self._make_tokenizer().with_slices(list(MASK_SLICES))
                logger.info("structured outputs: llguidance tokenizer built in %.2f s", time.perf_counter() - started)
            return self._lltokenizer

    def _grammar(self, spec: StructuredOutput) -> str:
        import llguidance
        from llguidance.gbnf_to_lark import gbnf_to_lark

        matcher = llguidance.LLMatcher
        if spec.json is not None:
            schema = spec.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise InvalidParamError(f"{spec.param}: the JSON schema is not JSON: {exc}", param=spec.param) from exc
            if not isinstance(schema, dict):
                raise InvalidParamError(f"{spec.param}: a JSON schema must be an object", param=spec.param)
            # llguidance reads only what it knows; a schema of "{}" is any JSON value.
            return matcher.grammar_from_json_schema(schema, defaults=_json_defaults(spec))
        if spec.json_object:
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=_json_defaults(spec))
        if spec.regex is not None:
            return matcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            return matcher.grammar_from_lark("start: " + " | ".join(_lark_string(c) for c in spec.choice))
        assert spec.grammar is not None
        text = spec.grammar
        if "::=" in text:  # GBNF (llama.cpp's grammars)
            try:
                text = gbnf_to_lark(text)
            except Exception as exc:  # its parser raises plain exceptions
                raise InvalidParamError(f"{spec.param}: not a valid GBNF grammar: {exc}", param=spec.param) from exc
        return matcher.grammar_from_lark(text)

    def compile(self, spec: StructuredOutput) -> Any:
        """A fresh ``LLMatcher`` for ``spec`` (``InvalidParamError`` naming ``spec.param``)."""
        key = spec.key()
        if len(key.encode()) > self.max_bytes:
            raise InvalidParamError(
                f"{spec.param} is {len(key.encode())} bytes; at most {self.max_bytes} are compiled", param=spec.param
            )
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return cached.deep_copy()
        tokenizer = self.lltokenizer()
        try:
            grammar = self._grammar(spec)
        except InvalidParamError:
            raise
        except ValueError as exc:
            raise InvalidParamError(f"{spec.param}: {exc}", param=spec.param) from exc
        started = time.perf_counter()
        future = self._pool.submit(self._build, tokenizer, grammar)
        try:
            built = future.result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            raise InvalidParamError(
                f"{spec.param}: the constraint did not compile within {self.compile_timeout_s:g} s; simplify it",
                param=spec.param,
            ) from None
        self.compile_seconds.append(time.perf_counter() - started)
        if built.is_error():
            raise InvalidParamError(f"{spec.param}: {built.get_error()}", param=spec.param)
        with self._lock:
            self._cache[key] = built
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return built.deep_copy()

    @staticmethod
    def _build(tokenizer: Any, grammar: str) -> Any:
        import llguidance

        limits = llguidance.LLParserLimits(
            # llguidance's defaults, spelled out: ~20 ms of lexer work to build, ~15 ms a step.
            initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
            max_grammar_size=500_000, max_lexer_states=250_000,
        )
        return llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
