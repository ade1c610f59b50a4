"""llama.cpp must not crash on any CPU of this project's machines (AMX, AVX-512, AVX2).

On a Xeon with AMX, a ``-march=native`` build of llama.cpp died with SIGSEGV in the first
multi-token ``llama_decode`` of the default model (its AMX buffer type takes Q4_1 weights).
``scripts/install_llamacpp.sh`` builds without AMX code, and
:func:`backends._llamacpp_safety.apply_cpu_safety` turns extra buffer types off for a build
that has it. The prompt evaluation here runs in a child process, so that a crash is a test
failure with its signal rather than the end of the test session.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from backends._llamacpp_safety import apply_cpu_safety, library_has_amx

pytestmark = pytest.mark.slow

_EVALUATE = textwrap.dedent(
    """
    import asyncio
    from backends.base import BackendConfig, GenerationRequest, SamplingParams
    from backends.llamacpp import create_backend
    from gateway.config.load import default_backends

    async def main():
        config = next(b for b in default_backends() if b.kind == "llamacpp")
        backend = create_backend(config)  # the default backend's real options
        await backend.start()
        prompt = ("The quick brown fox jumps over the lazy dog. " * 8).strip()
        request = GenerationRequest(
            request_id="amx", model="m", kind="completion", prompt=prompt,
            params=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        )
        chunks = [c async for c in backend.generate(request)]
        usage = chunks[-1].usage
        await backend.aclose()
        print(usage.prompt_tokens, usage.completion_tokens)

    asyncio.run(main())
    """
)


def test_the_installed_llama_cpp_has_no_amx_kernels() -> None:
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    assert not library_has_amx(), f"llama.cpp was built with AMX code: {info}"


def test_multi_token_prompt_evaluation_of_the_default_model_does_not_crash() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _EVALUATE], capture_output=True, text=True, timeout=300
    )
    if done.returncode < 0:
        pytest.fail(f"llama.cpp died with {signal.Signals(-done.returncode).name}:\n{done.stderr}")
    assert done.returncode == 0, done.stderr
    prompt_tokens, completion_tokens = map(int, done.stdout.split()[-2:])
    assert prompt_tokens > 64  # several batches of prompt evaluation, not one token
    assert completion_tokens == 8


def test_an_amx_build_serves_without_extra_buffer_types(monkeypatch: pytest.MonkeyPatch) -> None:
    import llama_cpp

    from backends import _llamacpp_safety

    params = llama_cpp.llama_model_default_params()
    assert params.use_extra_bufts  # llama.cpp's default: repack (and AMX where compiled in)
    apply_cpu_safety(params)
    assert params.use_extra_bufts == (not library_has_amx())
    # A wheel built elsewhere with AMX kernels (this machine's build has none to show it):
    monkeypatch.setattr(_llamacpp_safety, "library_has_amx", lambda: True)
    apply_cpu_safety(params)
    assert not params.use_extra_bufts
