"""The engine with its attention on the Triton kernels (the CUDA path), run here by the Triton
CPU interpreter in a child process (TRITON_INTERPRET=1 must be set before triton loads)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import sys
import torch
from core_engine.paged_attention import PagedAttention
from core_engine.sampling_params import SamplingParams
from tests.core_engine.engine_util import make_engine, reference_greedy, run_all
from tests.core_engine.gguf_factory import TinyLlamaSpec, write_llama_gguf

path = write_llama_gguf(sys.argv[1], spec=TinyLlamaSpec(num_layers=1))
engine = make_engine(path, max_num_batched_tokens=8)
runner = engine.model_runner
runner.attn = PagedAttention(runner.kv_cache, num_heads=engine.model_config.num_heads, use_kernels=True)
assert runner.attn.uses_kernel
prompts = {"a": [5, 6, 7], "b": list(range(3, 24)), "c": [40] * 17}
results = run_all(engine, prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
for rid, prompt in prompts.items():
    got, want = results[rid]["token_ids"], reference_greedy(engine, prompt, 5)
    assert got == want, (rid, got, want)
print("kernel path ok")
"""


def test_paged_engine_on_the_triton_kernels_matches_the_reference(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "tiny.gguf")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kernel path ok" in proc.stdout
