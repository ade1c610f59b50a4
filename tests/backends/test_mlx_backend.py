"""The MLX backend with the real default model (SmolLM2-135M-Instruct Q4_1 GGUF, loaded once).

MLX's Linux CPU build is slow (about 10 tokens/s here), so outputs are kept short.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import msgspec
import pytest
import pytest_asyncio

from backends.base import (
    BackendConfig,
    ChatMessage,
    GenerationChunk,
    GenerationRequest,
    SamplingParams,
)
from backends.errors import (
    BackendUnavailableError,
    ContextLengthExceededError,
    GenerationAbortedError,
    InvalidRequestError,
    UnsupportedParameterError,
)
from backends.mlx import create_backend
from backends.mlx.backend import MLXBackend
from gateway.config.load import config_from_dict

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend() -> AsyncIterator[MLXBackend]:
    mlx = create_backend(BackendConfig(name="mlx", kind="mlx", options={"n_ctx": 2048}))
    await mlx.start()
    yield mlx
    await mlx.aclose()


def _chat(*texts: str, **params: object) -> GenerationRequest:
    roles = ("user", "assistant")
    return GenerationRequest(
        request_id="r",
        model="smollm2",
        kind="chat",
        messages=tuple(ChatMessage(role=roles[i % 2], content=t) for i, t in enumerate(texts)),
        params=SamplingParams(**params),  # type: ignore[arg-type]
    )


def _completion(prompt: str, **params: object) -> GenerationRequest:
    return GenerationRequest(
        request_id="r",
        model="smollm2",
        kind="completion",
        prompt=prompt,
        params=SamplingParams(**params),  # type: ignore[arg-type]
    )


async def _collect(backend: MLXBackend, request: GenerationRequest) -> list[GenerationChunk]:
    return [chunk async for chunk in backend.generate(request)]


def _text(chunks: list[GenerationChunk]) -> str:
    return "".join(c.text for c in chunks)


async def test_streams_text_token_by_token_with_usage(backend: MLXBackend) -> None:
    chunks = await _collect(
        backend, _chat("What is the capital of France?", max_tokens=10, temperature=0)
    )
    assert len([c for c in chunks if c.text]) > 3  # streamed, not one blob
    assert "Paris" in _text(chunks)
    last = chunks[-1]
    assert last.finish_reason in ("stop", "length")
    assert last.usage is not None
    assert last.usage.prompt_tokens > 20  # the template's system prompt + the question
    assert 0 < last.usage.completion_tokens <= 10
    assert sum(len(c.token_ids) for c in chunks) == last.usage.completion_tokens
    info = backend.model_info()
    assert info.id == "SmolLM2-135M-Instruct.Q4_1"
    assert info.context_length == 2048
    assert info.chat_template is not None and "<|im_start|>" in info.chat_template


async def test_on_the_cpu_weights_are_made_float_for_openblas_or_stay_packed_when_asked(backend: MLXBackend) -> None:
    import mlx.nn as nn

    from backends.mlx.cpu_blas import use_openblas

    # OpenBLAS is under MLX's matmuls (NumPy's wheel has it; tests/conftest.py loads it before
    # any test module imports MLX), so the Q4_1/Q8_0 layers were made float32 at load.
    assert use_openblas() is not None
    model = backend._runner.model  # type: ignore[union-attr]
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    assert type(model.model.embed_tokens) is nn.Embedding
    packed = create_backend(BackendConfig(name="p", kind="mlx", options={"n_ctx": 256, "dequantize": False}))
    await packed.start()
    try:
        kept = packed._runner.model  # type: ignore[union-attr]
        attention = kept.model.layers[0].self_attn
        assert isinstance(attention.q_proj, nn.QuantizedLinear)
        assert (attention.q_proj.bits, attention.q_proj.group_size) == (4, 32)  # Q4_1 blocks
        assert isinstance(kept.model.embed_tokens, nn.QuantizedEmbedding)
        assert kept.model.embed_tokens.bits == 8  # the file's Q8_0 token embedding
        # The same weights either way: the same greedy answer.
        request = _chat("What is the capital of France?", max_tokens=8, temperature=0)
        assert _text(await _collect(packed, request)) == _text(await _collect(backend, request))
    finally:
        await packed.aclose()


async def test_same_seed_same_output(backend: MLXBackend) -> None:
    request = _chat("Write a poem about the sea.", max_tokens=12, temperature=1.0, seed=1234)
    first = _text(await _collect(backend, request))
    await _collect(backend, _completion("Something else entirely", max_tokens=2, seed=7))
    second = _text(await _collect(backend, request))
    other = _text(
        await _collect(
            backend, _chat("Write a poem about the sea.", max_tokens=12, temperature=1.0, seed=99)
        )
    )
    assert first == second
    assert first != other


async def test_stop_string_across_tokens_is_cut_and_not_leaked(backend: MLXBackend) -> None:
    request = _completion("The days of the week are Monday, Tuesday,", max_tokens=10, temperature=0)
    chunks = [c for c in await _collect(backend, request) if c.text]
    full = _text(chunks)
    # A stop string made of the end of one token and the start of the next.
    boundary = next(i for i in range(2, len(chunks)) if len(chunks[i].text) >= 2)
    stop = chunks[boundary - 1].text[-1:] + chunks[boundary].text[:2]
    stopped = await _collect(
        backend,
        _completion(str(request.prompt), max_tokens=10, temperature=0, stop=(stop,)),
    )
    assert _text(stopped) == full[: full.index(stop)]
    assert stopped[-1].finish_reason == "stop"


async def test_stop_token_id_ends_the_output_before_it(backend: MLXBackend) -> None:
    request = _completion("One, two, three, four,", max_tokens=6, temperature=0)
    chunks = await _collect(backend, request)
    ids = [t for c in chunks for t in c.token_ids]
    stop_id = ids[3]
    stopped = await _collect(
        backend,
        _completion(str(request.prompt), max_tokens=6, temperature=0, stop_token_ids=(stop_id,)),
    )
    assert [t for c in stopped for t in c.token_ids] == ids[: ids.index(stop_id)]
    assert stopped[-1].finish_reason == "stop"


async def test_ignore_eos_runs_to_max_tokens(backend: MLXBackend) -> None:
    chunks = await _collect(backend, _chat("Say OK.", max_tokens=8, temperature=0, ignore_eos=True))
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


async def test_logprobs_describe_the_sampled_tokens(backend: MLXBackend) -> None:
    chunks = await _collect(
        backend,
        _chat("Name a colour.", max_tokens=5, temperature=0, logprobs=True, top_logprobs=3),
    )
    entries = [e for c in chunks for e in (c.logprobs or ())]
    assert [e.token_id for e in entries] == [t for c in chunks for t in c.token_ids]
    assert "".join(e.token for e in entries) == _text(chunks)
    for entry in entries:
        assert entry.logprob is not None and entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        # Greedy: the sampled token is the most likely one.
        assert entry.top_logprobs[0].token_id == entry.token_id
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 2.0}, {"repetition_penalty": 1.5}])
async def test_penalties_discourage_repeats(backend: MLXBackend, penalty: dict[str, float]) -> None:
    prompt = "1 1 1 1 1 1 1 1 1 1 1 1"
    plain = _text(await _collect(backend, _completion(prompt, max_tokens=12, temperature=0)))
    penalised = _text(
        await _collect(backend, _completion(prompt, max_tokens=12, temperature=0, **penalty))
    )
    assert plain.count("1") >= 5  # the model continues the pattern...
    assert penalised.count("1") < plain.count("1")  # ...less so when repeats are penalised


async def test_follow_up_turn_reuses_the_cached_prefix(backend: MLXBackend) -> None:
    question = "Tell me a fact about owls."
    first = await _collect(backend, _chat(question, max_tokens=6, temperature=0))
    answer = _text(first)
    first_usage = first[-1].usage
    assert first_usage is not None
    follow_up = _chat(question, answer, "And one about cats?", max_tokens=6, temperature=0)
    warm = await _collect(backend, follow_up)
    assert warm[-1].usage is not None
    # Everything up to the end of the first answer came from the cache.
    assert warm[-1].usage.cached_tokens >= first_usage.prompt_tokens
    # A cold run (the cache now holds an unrelated prompt) gives the same output.
    await _collect(backend, _completion("Unrelated text.", max_tokens=1))
    cold = await _collect(backend, follow_up)
    assert cold[-1].usage is not None
    assert cold[-1].usage.cached_tokens < first_usage.prompt_tokens
    assert _text(cold) == _text(warm)


async def test_closing_the_stream_stops_generation(backend: MLXBackend) -> None:
    before = backend.num_generated_tokens
    stream = backend.generate(
        _chat("Count from one to a thousand.", max_tokens=400, ignore_eos=True)
    )
    for _ in range(3):
        await anext(stream)
    await stream.aclose()  # type: ignore[attr-defined]
    await backend.wait_idle()
    generated = backend.num_generated_tokens - before
    assert generated <= 6, f"{generated} tokens generated for a stream closed after 3"
    # What the abandoned stream left in the prompt cache is reused correctly.
    greedy = _chat("Count from one to a thousand.", max_tokens=5, temperature=0)
    warm = await _collect(backend, greedy)
    assert warm[-1].usage is not None and warm[-1].usage.cached_tokens
    await _collect(backend, _completion("Unrelated text.", max_tokens=1))
    assert _text(await _collect(backend, greedy)) == _text(warm)


async def test_cancelled_consumer_stops_generation(backend: MLXBackend) -> None:
    # The consumer is cancelled as its second token arrives (no polling on the clock). MLX's
    # thread runs ahead of the consumer by however long the event loop takes to hand the
    # cancellation over (a loaded 2-core machine: several tokens at ~0.1 s each), so what
    # must hold is that generation stops, far short of the 400 tokens asked for.
    before = backend.num_generated_tokens
    received = 0

    async def consume() -> None:
        nonlocal received
        async for _ in backend.generate(
            _chat("Tell a long story.", max_tokens=400, ignore_eos=True)
        ):
            received += 1
            if received == 2:
                task.cancel()

    task = asyncio.create_task(consume())
    with pytest.raises(asyncio.CancelledError):
        await task
    await backend.wait_idle()
    generated = backend.num_generated_tokens - before
    assert received == 2
    assert generated <= received + 20, f"{generated} tokens generated, {received} consumed"


async def test_closing_the_backend_aborts_running_and_queued_streams() -> None:
    mlx = create_backend(BackendConfig(name="closing", kind="mlx", options={"n_ctx": 512}))
    await mlx.start()
    running = mlx.generate(_completion("Once upon a time", max_tokens=200, ignore_eos=True))
    await anext(running)
    queued = asyncio.create_task(anext(mlx.generate(_completion("Hello", max_tokens=5))))
    await asyncio.sleep(0.2)  # the second request is now waiting behind the first
    await mlx.aclose()
    with pytest.raises(GenerationAbortedError):
        async for _ in running:
            pass
    with pytest.raises(GenerationAbortedError):
        await queued
    assert (await mlx.health()).ok is False


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (_completion("Hi", max_tokens=2, echo=True), "echo"),
    ],
)
async def test_unsupported_parameter_is_a_400_before_any_work(
    backend: MLXBackend, request_: GenerationRequest, param: str
) -> None:
    before = backend.num_generated_tokens
    with pytest.raises(UnsupportedParameterError) as caught:
        await anext(backend.generate(request_))
    assert caught.value.status_code == 400
    assert caught.value.param == param
    assert param in caught.value.message
    await backend.wait_idle()
    assert backend.num_generated_tokens == before


async def test_structured_outputs_constrain_mlx_with_the_same_masks(backend: MLXBackend) -> None:
    import json

    import jsonschema

    from tests.core_engine.structured_schemas import SCHEMAS

    # Every third schema of the suite (each feature of the shared compiler, which the core
    # engine and llama.cpp tests run on all of them: MLX applies the same masks). MLX's CPU
    # build decodes ~75 ms a token here, so the JSON is compact (vLLM's
    # disable_any_whitespace: the same masks, no tokens spent on whitespace between items).
    assert len(SCHEMAS) >= 30
    cut: list[str] = []
    for i, (name, what, schema) in enumerate(SCHEMAS):
        if i % 3:
            continue
        request = msgspec.structs.replace(
            _chat(f"Reply with {what} as JSON.", max_tokens=96, temperature=0.7, seed=i),
            structured_outputs={"json": schema, "disable_any_whitespace": True, "param": "response_format"},
        )
        chunks = await _collect(backend, request)
        if chunks[-1].finish_reason == "length":
            cut.append(name)  # cut by max_tokens: reported, not validated
            continue
        jsonschema.validate(json.loads(_text(chunks)), schema)
    assert len(cut) <= 1, cut  # every output that ended validated; as on the other backends, nearly all ended
    regex = msgspec.structs.replace(
        _completion("Code:", max_tokens=12, temperature=1.0, seed=3),
        structured_outputs={"regex": "[A-Z]{2}[0-9]{3}", "param": "guided_regex"},
    )
    assert re.fullmatch("[A-Z]{2}[0-9]{3}", _text(await _collect(backend, regex)))
    bad = msgspec.structs.replace(_chat("x", max_tokens=2), structured_outputs={"regex": "(", "param": "guided_regex"})
    with pytest.raises(InvalidRequestError) as caught:
        await _collect(backend, bad)
    assert caught.value.param == "guided_regex"


async def test_prompt_plus_max_tokens_beyond_the_context_is_rejected(backend: MLXBackend) -> None:
    with pytest.raises(ContextLengthExceededError) as caught:
        await anext(backend.generate(_chat("Hi", max_tokens=4000)))
    assert caught.value.param == "max_tokens"


async def test_capabilities_are_declared() -> None:
    mlx = create_backend(BackendConfig(name="m", kind="mlx"))
    assert mlx.capabilities.logprobs and mlx.capabilities.seed and mlx.capabilities.penalties
    assert not mlx.capabilities.echo and mlx.capabilities.structured_outputs
    with pytest.raises(BackendUnavailableError):  # not started: nothing to serve with
        await anext(mlx.generate(_chat("Hi", max_tokens=1)))


async def test_bad_options_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"backends\.m\.options\.n_ctxx"):
        create_backend(BackendConfig(name="m", kind="mlx", options={"n_ctxx": 5}))
    with pytest.raises(ValueError, match=r"backends\.m\.options\.dtype"):
        create_backend(BackendConfig(name="m", kind="mlx", options={"dtype": "int3"}))


async def test_options_come_from_the_config_file() -> None:
    toml = b"""
        [[backends]]
        name = "m"
        kind = "mlx"
        options = { prefill_step_size = 64, dtype = "float16" }
    """
    (config,) = config_from_dict(msgspec.toml.decode(toml)).backends
    options = create_backend(config).options
    assert (options.prefill_step_size, options.dtype) == (64, "float16")
    # The llama.cpp rounding emulation is gone: its option is an unknown key, named.
    with pytest.raises(ValueError, match=r"backends\.m\.options.*numerics"):
        create_backend(BackendConfig(name="m", kind="mlx", options={"numerics": "llamacpp"}))


async def test_missing_model_is_unavailable_not_a_download() -> None:
    mlx = create_backend(
        BackendConfig(name="m", kind="mlx", options={"model_path": "HuggingFaceTB/SmolLM2"})
    )
    with pytest.raises(BackendUnavailableError, match="model file not found"):
        await mlx.start()
