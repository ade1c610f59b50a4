"""Which implementation a kernel call runs: Triton or the pure-torch reference.

Every kernel in this package is a pair with one signature — a Triton launcher in
:mod:`core_engine.kernels.triton_ops` and a torch reference next to its dispatcher — and the
dispatcher asks :func:`use_triton` per call:

* CUDA tensors run Triton when ``triton`` imports;
* CPU tensors run Triton only under the Triton interpreter (``TRITON_INTERPRET=1``, which
  must be set before ``triton`` is first imported); that is how the kernels are tested on
  machines without a GPU;
* everything else runs torch, and ``INFERMUX_KERNELS=torch`` forces torch everywhere (to
  compare the two on a GPU, or to rule a kernel out while debugging).

The same switch turns off the C++ decode attention of :mod:`core_engine.kernels.cpu` that
:class:`~core_engine.paged_attention.PagedAttention` uses on the CPU (:func:`torch_forced`).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

__all__ = ["interpreter_enabled", "torch_forced", "triton_available", "use_triton"]

_BACKEND_ENV = "INFERMUX_KERNELS"
_BACKEND_CHOICES = ("auto", "torch")


@functools.cache
def triton_available() -> bool:
    """True when ``triton`` is installed and imports (the ``gpu`` or ``dev`` extra)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install (e.g. no matching driver) must not break torch users
        return False
    return True


def interpreter_enabled() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def torch_forced() -> bool:
    """True when ``INFERMUX_KERNELS=torch`` asks for the pure-torch path everywhere."""
    choice = os.environ.get(_BACKEND_ENV, "auto").strip().lower() or "auto"
    if choice not in _BACKEND_CHOICES:
        raise ValueError(f"{_BACKEND_ENV} must be one of {_BACKEND_CHOICES}, got {choice!r}")
    return choice == "torch"


def use_triton(device: torch.device) -> bool:
    """Whether a kernel on tensors of ``device`` should run its Triton implementation."""
    if torch_forced() or (device.type != "cuda" and not interpreter_enabled()):
        return False
    return triton_available()  # checked last: importing triton is not free
