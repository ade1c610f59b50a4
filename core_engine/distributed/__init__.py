"""Tensor parallelism: one engine's weights split over N ranks (processes), Megatron-style.

* :mod:`~core_engine.distributed.partition` - which heads, intermediate columns and
  vocabulary rows each rank owns (uneven splits allowed; KV heads replicated when there are
  more ranks than KV heads);
* :mod:`~core_engine.distributed.sharding` - a loaded model cut to one rank's shard, with an
  all-reduce after the row-parallel products and the vocab-parallel embedding and head;
* :mod:`~core_engine.distributed.group` - the process group (gloo on CPU, NCCL on CUDA);
* :mod:`~core_engine.distributed.launcher` - rank 0 starting the other ranks and sending
  each step's batch; :mod:`~core_engine.distributed.worker` - the other ranks' loop.

The engine (:class:`~core_engine.llm_engine.LLMEngine`) is rank 0 when
``EngineConfig.tensor_parallel_size > 1``: one scheduler, one sampler; the other ranks only
run forward passes. docs/tensor-parallel-notes.md has the design and the measurements.
"""
