"""Workloads: the prompts a benchmark sends, synthesised offline from a seed or read from a file.

Lengths are in tokens of the server's tokenizer, which the tool does not have. Synthetic text is
built from :data:`~gateway.bench.word_list.WORDS`, and a length of ``n`` tokens becomes
``round(n / tokens_per_word)`` words. ``tokens_per_word`` is measured on the endpoint before
the run (:func:`gateway.bench.runner.calibrate`) or given on the command line; 1.3 is the
fallback when neither is possible. ``input_len`` counts the tokens of the message contents; the
chat template adds a few tokens per message on top, which the server's ``usage.prompt_tokens``
includes.

Workloads (``--workload NAME``):

- ``fixed``: every prompt has ``input_len`` tokens and asks for ``output_len``.
- ``shared-prefix``: a long system prompt shared by all requests (``num_prefixes`` groups)
  followed by a short, distinct question; exposes prefix caching.
- ``chat``: one to four turns, with or without a system prompt; input and output lengths are
  lognormal with means ``input_len``/``output_len`` (each prompt's own target is in its
  ``input_len``/``output_len``); a stand-in for a chat dataset, made offline.
- ``code-edit``: a synthetic Python file and an instruction to rename one function and return
  the whole file, so the output repeats most of the input (exposes speculative decoding).
- a path to a JSONL file: one object per line with ``prompt`` (a string) or ``messages``
  (OpenAI chat messages), and optionally ``output_len`` or ``max_tokens``.
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import msgspec

from gateway.bench.errors import BenchConfigError
from gateway.bench.word_list import WORDS

__all__ = [
    "DEFAULT_TOKENS_PER_WORD",
    "WORKLOAD_NAMES",
    "BenchPrompt",
    "WorkloadSpec",
    "build_workload",
    "estimate_code_tokens",
    "sentences",
]

# The usual rule of thumb for English text in BPE vocabularies; only used when calibration
# against the endpoint is impossible (no usage in the reply) and no value was given.
DEFAULT_TOKENS_PER_WORD = 1.3
DEFAULT_OUTPUT_LEN = 128
WORKLOAD_NAMES = ("fixed", "shared-prefix", "chat", "code-edit")
DEFAULT_NUM_REQUESTS = 100

# Approximate token cost of the code-edit instruction wrapped around the file, in words.
_CODE_INSTRUCTION = (
    "Rename the function {old} to {new} everywhere in the file below, including its calls. "
    "Reply with the complete edited file and nothing else.\n\n```python\n"
)
_CODE_SYSTEM = "You are a careful code editor."
_MIN_CODE_TOKENS = 64  # one generated function is 40 to 60 tokens


class BenchPrompt(msgspec.Struct, kw_only=True, frozen=True):
    """One request of a workload."""

    messages: list[dict[str, str]]  # OpenAI chat messages (role, content)
    input_len: int  # estimated tokens of the message contents (template excluded)
    output_len: int  # max_tokens sent with the request
    expected_output: str | None = None  # code-edit: the text a perfect model would return

    @property
    def prompt(self) -> str:
        """The same content as one string, for the completions endpoint."""
        return "\n\n".join(message["content"] for message in self.messages)


class WorkloadSpec(msgspec.Struct, kw_only=True, frozen=True):
    """What to generate: a workload name (or a JSONL path) and its sizes."""

    name: str  # one of WORKLOAD_NAMES, or a path to a JSONL file
    num_requests: int | None = None  # None: 100, or every line of a file
    input_len: int = 256
    output_len: int | None = None  # None: 128 (code-edit: the file's length)
    prefix_len: int | None = None  # shared-prefix: tokens of the shared part; None: 3/4 input
    num_prefixes: int = 1  # shared-prefix: number of distinct shared prompts


def sentences(rng: random.Random, num_words: int) -> str:
    """``num_words`` random words arranged in capitalised sentences of 6 to 14 words."""
    words: list[str] = []
    sentence_left = 0
    for _ in range(num_words):
        word = rng.choice(WORDS)
        if sentence_left == 0:
            if words:
                words[-1] += "."
            word = word.capitalize()
            sentence_left = rng.randint(6, 14)
        words.append(word)
        sentence_left -= 1
    if words:
        words[-1] += "."
    return " ".join(words)


def _num_words(num_tokens: int, tokens_per_word: float) -> int:
    return max(1, round(num_tokens / tokens_per_word))


def _estimate_text_tokens(num_words: int, tokens_per_word: float) -> int:
    return round(num_words * tokens_per_word)


def build_workload(spec: WorkloadSpec, *, seed: int, tokens_per_word: float) -> list[BenchPrompt]:
    """The prompts of ``spec``: the same ``spec``, ``seed`` and ``tokens_per_word`` give the
    same prompts."""
    if tokens_per_word <= 0:
        raise BenchConfigError("tokens_per_word must be positive", param="tokens_per_word")
    if spec.num_requests is not None and spec.num_requests < 1:
        raise BenchConfigError("must be at least 1", param="num_requests")
    if spec.output_len is not None and spec.output_len < 1:
        raise BenchConfigError("must be at least 1", param="output_len")
    if spec.name not in WORKLOAD_NAMES:
        return _from_file(spec, tokens_per_word)
    if spec.input_len < 1:
        raise BenchConfigError("must be at least 1", param="input_len")
    num_requests = spec.num_requests or DEFAULT_NUM_REQUESTS
    # A string seed keeps workload text independent of the arrival-time generator's stream.
    rng = random.Random(f"workload:{spec.name}:{seed}")
    match spec.name:
        case "fixed":
            return _fixed(spec, num_requests, rng, tokens_per_word)
        case "shared-prefix":
            return _shared_prefix(spec, num_requests, rng, tokens_per_word)
        case "chat":
            return _chat(spec, num_requests, rng, tokens_per_word)
        case _:
            return _code_edit(spec, num_requests, rng, tokens_per_word)


def _fixed(
    spec: WorkloadSpec, num_requests: int, rng: random.Random, tokens_per_word: float
) -> list[BenchPrompt]:
    num_words = _num_words(spec.input_len, tokens_per_word)
    output_len = spec.output_len or DEFAULT_OUTPUT_LEN
    return [
        BenchPrompt(
            messages=[{"role": "user", "content": sentences(rng, num_words)}],
            input_len=_estimate_text_tokens(num_words, tokens_per_word),
            output_len=output_len,
        )
        for _ in range(num_requests)
    ]


def _shared_prefix(
    spec: WorkloadSpec, num_requests: int, rng: random.Random, tokens_per_word: float
) -> list[BenchPrompt]:
    prefix_len = spec.prefix_len if spec.prefix_len is not None else spec.input_len * 3 // 4
    if not 1 <= prefix_len < spec.input_len:
        raise BenchConfigError(
            f"must be between 1 and input_len - 1 ({spec.input_len - 1}), got {prefix_len}",
            param="prefix_len",
        )
    if spec.num_prefixes < 1:
        raise BenchConfigError("must be at least 1", param="num_prefixes")
    prefix_words = _num_words(prefix_len, tokens_per_word)
    question_words = _num_words(spec.input_len - prefix_len, tokens_per_word)
    prefixes = [sentences(rng, prefix_words) for _ in range(spec.num_prefixes)]
    output_len = spec.output_len or DEFAULT_OUTPUT_LEN
    prompts = []
    for index in range(num_requests):
        # Round-robin over groups: each group's prefix is reused evenly through the run.
        prompts.append(
            BenchPrompt(
                messages=[
                    {"role": "system", "content": prefixes[index % spec.num_prefixes]},
                    {"role": "user", "content": sentences(rng, question_words)},
                ],
                input_len=_estimate_text_tokens(prefix_words + question_words, tokens_per_word),
                output_len=output_len,
            )
        )
    return prompts


def _lognormal_len(rng: random.Random, mean: int, sigma: float, low: int, high: int) -> int:
    # mu = ln(mean) - sigma^2 / 2 puts the distribution's mean (not its median) at ``mean``.
    return min(high, max(low, round(mean * math.exp(rng.gauss(-sigma * sigma / 2, sigma)))))


def _chat(
    spec: WorkloadSpec, num_requests: int, rng: random.Random, tokens_per_word: float
) -> list[BenchPrompt]:
    output_mean = spec.output_len or DEFAULT_OUTPUT_LEN
    prompts = []
    for _ in range(num_requests):
        # Lognormal lengths: the long right tail of real chat traffic, mean at the asked size.
        total = _lognormal_len(rng, spec.input_len, 0.6, 4, 4 * spec.input_len)
        output_len = _lognormal_len(rng, output_mean, 0.5, 1, 4 * output_mean)
        has_system = rng.random() < 0.5
        max_turns = max(1, min(4, total // 24))
        num_turns = rng.randint(1, max_turns)
        roles = (["system"] if has_system else []) + ["user", "assistant"] * (num_turns - 1)
        roles.append("user")
        weights = [rng.uniform(0.5, 1.5) for _ in roles]
        total_words = _num_words(total, tokens_per_word)
        shares = _split(total_words, weights)
        messages = [
            {"role": role, "content": sentences(rng, words)}
            for role, words in zip(roles, shares, strict=True)
            if words > 0
        ]
        prompts.append(
            BenchPrompt(
                messages=messages,
                input_len=_estimate_text_tokens(sum(shares), tokens_per_word),
                output_len=output_len,
            )
        )
    return prompts


def _split(total: int, weights: list[float]) -> list[int]:
    """``total`` split in proportion to ``weights``; the last part is never empty."""
    scale = sum(weights)
    shares = [int(total * weight / scale) for weight in weights]
    shares[-1] += total - sum(shares)
    return shares


_PIECE = re.compile(r"[A-Za-z]+|\d+|\n| {4}|[^\w\s]")


def estimate_code_tokens(code: str, tokens_per_word: float) -> int:
    """Approximate tokens of source code: words at ``tokens_per_word``, other pieces at one."""
    num_words = 0
    num_other = 0
    for piece in _PIECE.findall(code):
        if piece[0].isalpha():
            num_words += 1
        else:
            num_other += 1
    # BPE vocabularies merge many operator/punctuation runs ("):", "()", '"""'); 0.8 per
    # non-word piece matched SmolLM2's and GPT-2's tokenizers within a few percent.
    return round(num_words * tokens_per_word + 0.8 * num_other)


def _identifier(rng: random.Random, num_words: int) -> str:
    return "_".join(rng.choice(WORDS) for _ in range(num_words))


def _function(rng: random.Random, name: str, callee: str | None) -> str:
    args = [_identifier(rng, 1) for _ in range(rng.randint(1, 3))]
    first = args[0]
    lines = [
        f"def {name}({', '.join(args)}):",
        f'    """Return the {rng.choice(WORDS)} {rng.choice(WORDS)} of {first}."""',
        f"    result = {first} * {rng.randint(2, 99)}",
    ]
    for arg in args[1:]:
        lines.append(f"    result += {arg}")
    if rng.random() < 0.6:
        lines += [
            f"    if result > {rng.randint(10, 999)}:",
            f"        result = result // {rng.randint(2, 9)}",
        ]
    if callee is not None:
        lines.append(f"    result = {callee}(result)")
    lines.append("    return result")
    return "\n".join(lines) + "\n"


def _code_file(rng: random.Random, num_tokens: int, tokens_per_word: float) -> tuple[str, str]:
    """A Python file of about ``num_tokens`` tokens, and the name of one function in it."""
    target = _identifier(rng, 2)
    functions = [_function(rng, target, None)]
    names = [target]
    while estimate_code_tokens("\n".join(functions), tokens_per_word) < num_tokens:
        name = _identifier(rng, 2)
        # Later functions call the target now and then, so the rename touches several lines.
        callee = target if rng.random() < 0.4 else rng.choice(names)
        functions.append(_function(rng, name, callee))
        names.append(name)
    if len(functions) > 1:
        over = estimate_code_tokens("\n".join(functions), tokens_per_word) - num_tokens
        under = num_tokens - estimate_code_tokens("\n".join(functions[:-1]), tokens_per_word)
        if under < over:  # the last function overshoots more than leaving it out undershoots
            functions.pop()
    return "\n".join(functions), target


def _code_edit(
    spec: WorkloadSpec, num_requests: int, rng: random.Random, tokens_per_word: float
) -> list[BenchPrompt]:
    instruction_tokens = estimate_code_tokens(
        _CODE_SYSTEM + _CODE_INSTRUCTION.format(old="a_b", new="c_d"), tokens_per_word
    )
    code_tokens = spec.input_len - instruction_tokens
    if code_tokens < _MIN_CODE_TOKENS:
        raise BenchConfigError(
            f"code-edit needs at least {instruction_tokens + _MIN_CODE_TOKENS} tokens "
            f"(instruction and one function), got {spec.input_len}",
            param="input_len",
        )
    prompts = []
    for _ in range(num_requests):
        code, old = _code_file(rng, code_tokens, tokens_per_word)
        new = _identifier(rng, 2)
        edited = re.sub(rf"\b{old}\b", new, code)
        user = _CODE_INSTRUCTION.format(old=old, new=new) + code + "```"
        content_tokens = estimate_code_tokens(_CODE_SYSTEM + user, tokens_per_word)
        output_len = spec.output_len or estimate_code_tokens(edited, tokens_per_word) + 8
        prompts.append(
            BenchPrompt(
                messages=[
                    {"role": "system", "content": _CODE_SYSTEM},
                    {"role": "user", "content": user},
                ],
                input_len=content_tokens,
                output_len=output_len,
                expected_output=edited,
            )
        )
    return prompts


class _FileLine(msgspec.Struct, kw_only=True):
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    output_len: int | None = None
    max_tokens: int | None = None


def _from_file(spec: WorkloadSpec, tokens_per_word: float) -> list[BenchPrompt]:
    path = Path(spec.name)
    if not path.is_file():
        raise BenchConfigError(
            f"{spec.name!r} is neither a workload ({', '.join(WORKLOAD_NAMES)}) nor a file",
            param="workload",
        )
    prompts: list[BenchPrompt] = []
    decoder = msgspec.json.Decoder(_FileLine)
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                entry = decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise BenchConfigError(f"{path}:{line_number}: {exc}", param="workload") from exc
            if (entry.prompt is None) == (entry.messages is None):
                raise BenchConfigError(
                    f"{path}:{line_number}: give exactly one of 'prompt' or 'messages'",
                    param="workload",
                )
            messages = entry.messages or [{"role": "user", "content": entry.prompt or ""}]
            num_words = sum(len(m.get("content", "").split()) for m in messages)
            # --output-len, when given, overrides the file so a run can fix the output length.
            output_len = spec.output_len or entry.output_len or entry.max_tokens
            prompts.append(
                BenchPrompt(
                    messages=messages,
                    input_len=_estimate_text_tokens(num_words, tokens_per_word),
                    output_len=output_len or DEFAULT_OUTPUT_LEN,
                )
            )
    if not prompts:
        raise BenchConfigError(f"{path} holds no prompts", param="workload")
    if spec.num_requests is None:
        return prompts
    # Fewer lines than requests: cycle through the file in order.
    return [prompts[index % len(prompts)] for index in range(spec.num_requests)]
