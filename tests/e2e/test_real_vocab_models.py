"""Every architecture the core engine runs, with a real vocabulary and its family's real chat
template, served end to end by ``infermux serve``.

For each architecture a tiny random-weight model (:mod:`tests.core_engine.hf_factory`, hidden
64, two layers) gets the tokenizer of one of llama.cpp's ``ggml-vocab-*.gguf`` files (every
``tokenizer.*`` key, and as many embedding and output rows as it has tokens) and a template
of ``models/templates`` (:func:`tests.core_engine.gguf_factory.write_with_vocab`). All of
them are served by ONE gateway subprocess (``infermux serve --config``, one in-process
``core_engine`` backend per model, so torch is imported once, and a ``llamacpp`` one beside
it, as llama.cpp loads every one of these architectures), and asked through the official
``openai`` client: a chat, a streamed chat, a chat with tools offered, and ``POST /tokenize``.
The models' text is noise; what is checked is the plumbing: status, shapes, usage, valid tool
arguments, and token ids equal to the engine's tokenizer on the same file.

Every vocabulary of the corpus is either served here or listed in :data:`NOT_SERVED` with the
reason (``test_every_corpus_vocab_is_served_or_listed``): none is skipped silently.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from core_engine.chat.template import ChatTemplate
from core_engine.tokenizer import Tokenizer
from core_engine.tokenizer.gguf import read_gguf_metadata, tokenizer_from_gguf_metadata
from tests.artifact_cache import cached_file, file_sha256, versions
from tests.core_engine.gguf_factory import write_with_vocab
from tests.real_artifacts import templates_dir, vocab_dir
from tests.telemetry.served_process import ServedGateway

pytestmark = pytest.mark.slow



@dataclass(frozen=True)
class Case:
    """One served model: an engine architecture, a corpus vocabulary and a corpus template."""

    name: str
    arch: str  # a tests.core_engine.hf_factory architecture
    vocab: str  # ggml-vocab-<vocab>.gguf
    template: str  # models/templates/<template>
    #: The template raises on a system message (Gemma 2's does): the chats send none.
    system: bool = True

    @property
    def messages(self) -> list[dict[str, str]]:
        return MESSAGES if self.system else MESSAGES[1:]


#: One model per architecture the engine supports (hf_factory.ARCHITECTURES: llama, qwen2,
#: qwen3, qwen3moe, phi3, mixtral, gemma2, gemma3), with the vocabulary of its family where
#: the corpus has one, plus llama-architecture families with their own vocabularies.
CASES = (
    Case("llama", "llama", "llama-bpe", "meta-llama-Llama-3.1-8B-Instruct.jinja"),
    Case("qwen2", "qwen2", "qwen2", "Qwen-Qwen2.5-7B-Instruct.jinja"),
    # Qwen3's vocabulary is Qwen2's (qwen35 is Qwen3.5's, architecture qwen35).
    Case("qwen3", "qwen3", "qwen2", "Qwen-Qwen3-0.6B.jinja"),
    Case("qwen3moe", "qwen3moe", "qwen2", "Qwen3-Coder.jinja"),
    Case("phi3", "phi3", "phi-3", "microsoft-Phi-3.5-mini-instruct.jinja"),
    # Mixtral's own tokenizer is Llama 2's SentencePiece vocabulary (32000 pieces).
    Case("mixtral", "mixtral", "llama-spm", "mistralai-Mistral-Nemo-Instruct-2407.jinja"),
    # Gemma 2 / 3's 256k SentencePiece vocabulary is not in the corpus: Gemma 4's is the nearest.
    Case("gemma2", "gemma2", "gemma-4", "google-gemma-2-2b-it.jinja", system=False),
    Case("gemma3", "gemma3", "gemma-4", "google-gemma-4-31B-it.jinja"),
    # DeepSeek Coder is a llama-architecture model (its 32k vocabulary is cheap to load).
    Case("deepseek-coder", "llama", "deepseek-coder", "llama-cpp-deepseek-r1.jinja"),
)

#: Corpus vocabularies not served here, and why (their architectures are not the engine's).
NOT_SERVED = {
    "aquila": "Aquila's BPE vocabulary: the tokenizer is checked in test_vocab_corpus; not served here (time)",
    "baichuan": "architecture baichuan: not run by the core engine",
    "bert-bge": "tokenizer 'bert' (WordPiece): refused by the engine's tokenizer loader",
    "command-r": "architecture command-r (Cohere): not run by the core engine",
    "deepseek-llm": "a llama-architecture vocabulary like deepseek-coder's, which is served; its 102k tokens "
    "would add ~15 s of engine load (tokenizer checked in test_vocab_corpus)",
    "falcon": "architecture falcon: not run by the core engine",
    "gpt-2": "architecture gpt2: not run by the core engine",
    "gpt-neox": "architecture gptneox: not run by the core engine",
    "mpt": "architecture mpt: not run by the core engine",
    "nomic-bert-moe": "architecture nomic-bert-moe (an embedding encoder): not run by the core engine",
    "qwen35": "architecture qwen35 (Qwen3.5): not run by the core engine (qwen3 is served with Qwen2's vocabulary)",
    "refact": "architecture refact: not run by the core engine",
    "starcoder": "architecture starcoder: not run by the core engine",
}

#: Engine architectures without a model here, and why (none at present).
ARCHITECTURES_NOT_SERVED: dict[str, str] = {}

#: (case, backend kind) pairs; llama.cpp loads each of these files too.
BACKENDS = ("core_engine", "llamacpp")
SERVED = [(case, kind) for case in CASES for kind in BACKENDS]

MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Hello there! What's 2+2? Answer in one word, s'il vous plaît."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    }
]
PROMPT = "Hello world! Ünïcödé café 日本語 🎉 def f(x):\n    return x**2  <|endoftext|>"


def alias(case: Case, kind: str) -> str:
    return case.name if kind == "core_engine" else f"{case.name}-{kind}"


def _ids(served: list[tuple[Case, str]]) -> list[str]:
    return [alias(case, kind) for case, kind in served]


@dataclass
class Gateway:
    base: str
    client: openai.OpenAI
    files: dict[str, Path]


def _recipe(case: Case) -> dict[str, object]:
    """Everything that decides the bytes of ``case``'s file (its key in the artifact cache)."""
    import torch

    here = Path(__file__).resolve().parents[1] / "core_engine"
    return {
        "case": case.name, "arch": case.arch, "max_position_embeddings": 4096,
        "layers": 2 if case.arch == "gemma3" else None,
        "vocab_sha256": file_sha256(vocab_dir() / f"ggml-vocab-{case.vocab}.gguf"),
        "template_sha256": file_sha256(templates_dir() / case.template),
        "sources_sha256": file_sha256(here / "hf_factory.py", here / "gguf_factory.py"),
        "torch": torch.__version__, **versions("transformers", "gguf"),
    }


def model_file(case: Case) -> tuple[Path, bool]:
    """The tiny random model of ``case``'s architecture with its vocabulary and template
    (context 4096: the real templates' tool prompts are long), from the test-artifact cache
    (``scripts/build_test_artifacts.py`` writes them all); whether it was built now."""
    from tests.core_engine.hf_factory import tiny_hf_model, write_gguf

    def build(partial: Path) -> None:
        layers = {"num_hidden_layers": 2} if case.arch == "gemma3" else {}
        base = write_gguf(tiny_hf_model(case.arch, max_position_embeddings=4096, **layers),
                          partial.with_suffix(".base.tmp"))
        try:
            write_with_vocab(base, vocab_dir() / f"ggml-vocab-{case.vocab}.gguf", partial,
                             chat_template=(templates_dir() / case.template).read_text(encoding="utf-8"))
        finally:
            base.unlink(missing_ok=True)

    return cached_file(f"vocab-model-{case.name}", _recipe(case), build)


def _write_models() -> dict[str, Path]:
    return {case.name: model_file(case)[0] for case in CASES}


def _config(files: dict[str, Path]) -> str:
    """One in-process backend per (model, kind) and one alias each."""
    lines: list[str] = []
    for case, kind in SERVED:
        name = alias(case, kind)
        lines += ["[[backends]]", f'name = "{name}"', f'kind = "{kind}"', "worker_process = false", "", "[backends.options]"]
        lines.append(f"model_path = {json.dumps(str(files[case.name]))}")
        if kind == "core_engine":
            lines += ['weight_format = "dense"', 'dtype = "float32"', "num_threads = 1", "kv_cache_memory_mb = 16",
                      "max_num_seqs = 4", "seed = 0"]
        else:
            lines += ["n_ctx = 4096", "parallel = 1", "n_threads = 1", "seed = 0"]
        lines.append("")
    for case, kind in SERVED:
        name = alias(case, kind)
        lines += ["[[models]]", f'alias = "{name}"', f'backends = ["{name}"]', ""]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    directory = tmp_path_factory.mktemp("real-vocab-models")
    files = _write_models()
    config = directory / "config.toml"
    config.write_text(_config(files), encoding="utf-8")
    # The shared `infermux serve` subprocess of the telemetry tests: its ledger beside the log.
    served = ServedGateway(config, env={}, log=directory / "infermux.log")
    try:
        served.wait_ready(timeout_s=180)
        with openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
            yield Gateway(served.url, client, files)
    finally:
        assert served.stop() == 0, served.log.read_text()[-4000:]


def _tokenizer(path: Path) -> Tokenizer:
    return tokenizer_from_gguf_metadata(read_gguf_metadata(path))


# -- the corpus is covered ------------------------------------------------------------------


def test_every_corpus_vocab_is_served_or_listed() -> None:
    found = {p.name.removeprefix("ggml-vocab-").removesuffix(".gguf") for p in vocab_dir().glob("ggml-vocab-*.gguf")}
    served = {case.vocab for case in CASES}
    assert served <= found
    assert sorted(found - served) == sorted(NOT_SERVED), "a corpus vocabulary is neither served nor listed"
    assert all((templates_dir() / case.template).is_file() for case in CASES)


def test_every_engine_architecture_is_served() -> None:
    from core_engine.gguf_loader import SUPPORTED_ARCHITECTURES
    from tests.core_engine.hf_factory import ARCHITECTURES, gguf_architecture

    assert {gguf_architecture(case.arch) for case in CASES} | set(ARCHITECTURES_NOT_SERVED) == set(SUPPORTED_ARCHITECTURES)
    assert {case.arch for case in CASES} >= set(ARCHITECTURES)


def test_the_files_carry_the_vocab_and_template(gateway: Gateway) -> None:
    for case in CASES:
        meta = read_gguf_metadata(gateway.files[case.name])
        vocab = read_gguf_metadata(vocab_dir() / f"ggml-vocab-{case.vocab}.gguf")
        assert meta["tokenizer.ggml.tokens"] == vocab["tokenizer.ggml.tokens"], case.name
        assert meta["tokenizer.chat_template"] == (templates_dir() / case.template).read_text(encoding="utf-8")
    served = {m.id for m in gateway.client.models.list().data}
    assert served >= set(_ids(SERVED))


# -- each model served ----------------------------------------------------------------------


@pytest.mark.parametrize(("case", "kind"), SERVED, ids=_ids(SERVED))
def test_chat(gateway: Gateway, case: Case, kind: str) -> None:
    model = alias(case, kind)
    response = gateway.client.chat.completions.with_raw_response.create(
        model=model, messages=case.messages, max_tokens=8, seed=1  # type: ignore[arg-type]
    )
    assert response.http_response.status_code == 200
    completion = response.parse()
    message = completion.choices[0].message
    assert message.role == "assistant"
    assert isinstance(message.content, str) or message.tool_calls
    assert completion.choices[0].finish_reason in ("stop", "length", "tool_calls")
    usage = completion.usage
    assert usage is not None and 0 < usage.completion_tokens <= 8
    # The prompt the chat was generated from is the one /tokenize renders for these messages.
    tokens = httpx.post(f"{gateway.base}/tokenize", json={"model": model, "messages": case.messages}).json()
    assert usage.prompt_tokens == tokens["count"] > 0
    if not case.system:  # the template's own refusal is the client's error, not a 500
        with pytest.raises(openai.BadRequestError, match="System role not supported"):
            gateway.client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8)  # type: ignore[arg-type]


@pytest.mark.parametrize(("case", "kind"), SERVED, ids=_ids(SERVED))
def test_streamed_chat(gateway: Gateway, case: Case, kind: str) -> None:
    stream = gateway.client.chat.completions.create(  # type: ignore[call-overload]
        model=alias(case, kind), messages=case.messages, max_tokens=8, seed=2, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and with_choices[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role in (None, "assistant") for c in with_choices)
    finishes = [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason is not None]
    assert len(finishes) == 1 and finishes[0] in ("stop", "length", "tool_calls")
    assert chunks[-1].usage is not None and not chunks[-1].choices
    assert 0 < chunks[-1].usage.completion_tokens <= 8 and chunks[-1].usage.prompt_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


#: Known failures with tools offered, by case (each backend): bugs found by this file, kept
#: strict so that the fix turns them into failures to remove from here.
TOOLS_KNOWN_FAILURES: dict[str, str] = {
    # Emptied when both were fixed: Gemma 2's template has no system role (the fallback tool
    # prompt now heads the first user turn), and DeepSeek-R1's `tools | map(...) | tojson`
    # (tojson now lists a generator).
}
TOOLS_SERVED = [
    pytest.param(case, kind, id=alias(case, kind), marks=pytest.mark.xfail(
        reason=TOOLS_KNOWN_FAILURES[case.name], strict=True, raises=openai.BadRequestError))
    if case.name in TOOLS_KNOWN_FAILURES else pytest.param(case, kind, id=alias(case, kind))
    for case, kind in SERVED
]


@pytest.mark.parametrize(("case", "kind"), TOOLS_SERVED)
def test_chat_with_tools_offered(gateway: Gateway, case: Case, kind: str) -> None:
    response = gateway.client.chat.completions.with_raw_response.create(
        model=alias(case, kind), messages=case.messages, tools=TOOLS, max_tokens=8, seed=3  # type: ignore[arg-type]
    )
    assert response.http_response.status_code == 200
    completion = response.parse()
    message = completion.choices[0].message
    # Noise rarely calls a tool; when the parser finds one its arguments must be JSON.
    for call in message.tool_calls or []:
        assert call.type == "function"
        assert call.function.name  # type: ignore[union-attr]
        assert isinstance(json.loads(call.function.arguments), dict)  # type: ignore[union-attr]
    assert isinstance(message.content, str) or message.tool_calls
    assert completion.usage is not None and completion.usage.prompt_tokens > 0


@pytest.mark.parametrize(("case", "kind"), SERVED, ids=_ids(SERVED))
def test_tokenize_answers_the_engines_tokens(gateway: Gateway, case: Case, kind: str) -> None:
    path = gateway.files[case.name]
    tokenizer = _tokenizer(path)
    model = alias(case, kind)
    answer = httpx.post(f"{gateway.base}/tokenize", json={"model": model, "prompt": PROMPT})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["tokens"] == tokenizer.encode(PROMPT, add_special=True, parse_special=True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    # Messages: the template rendered (the file's own, with its BOS/EOS texts), then encoded.
    answer = httpx.post(f"{gateway.base}/tokenize", json={"model": model, "messages": case.messages})
    assert answer.status_code == 200, answer.text
    special = {i: tokenizer.token_to_bytes(i, skip_special=False).decode("utf-8", errors="replace")
               for i in (tokenizer.bos_token_id, tokenizer.eos_token_id) if i is not None}
    bos = special.get(tokenizer.bos_token_id, "") if tokenizer.bos_token_id is not None else ""
    eos = special.get(tokenizer.eos_token_id, "") if tokenizer.eos_token_id is not None else ""
    text = ChatTemplate(tokenizer.chat_template or "", bos_token=bos, eos_token=eos).render(case.messages)
    add_bos = not (bos and text.startswith(bos))
    assert answer.json()["tokens"] == tokenizer.encode(text, add_special=add_bos, parse_special=True)
