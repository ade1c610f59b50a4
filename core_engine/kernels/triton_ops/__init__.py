"""Triton implementations of :mod:`core_engine.kernels`; importing any module here imports triton.

Each module holds the ``@triton.jit`` kernels of one operation and a launcher with the same
signature as the torch reference (plus tuning keywords the tests use to reach every code
path). Launchers take CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``.

Two habits hold throughout: values are converted to fp32 right after loading (the
interpreter multiplies bf16 bit patterns wrongly in ``tl.dot``, and fp32 math keeps the
kernels within rounding of the references), and offsets that scale with the cache size are
computed in int64.
"""
