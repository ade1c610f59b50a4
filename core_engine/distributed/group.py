"""The ranks' process group: gloo on CPU, NCCL on CUDA, rendezvous through a TCP store on
loopback; the two collectives a sharded forward pass needs.

The group is built from torch's process-group classes directly rather than
``init_process_group``: no process-global default group, so one process can hold several
engines (tests build TP=2 and TP=3 engines one after the other), and every collective carries
the group's timeout (a rank that died or hangs fails the step within ``timeout_s`` instead of
blocking it for ever).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["TensorParallelGroup"]

#: Longest wait for every rank to join the group.
_RENDEZVOUS_TIMEOUT_S = 300.0


class TensorParallelGroup:
    """``world_size`` ranks summing and gathering activations; ``rank`` is this process's."""

    def __init__(self, *, rank: int, world_size: int, port: int, device: str, timeout_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        # Meeting waits for every rank to start (a Python and torch import each: seconds on a
        # busy machine), however short the collectives' timeout.
        meet = datetime.timedelta(seconds=max(timeout_s, _RENDEZVOUS_TIMEOUT_S))
        self._store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=meet)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._pg: Any = dist.ProcessGroupNCCL(self._store, rank, world_size, options)
        else:
            self._pg = dist.ProcessGroupGloo(self._store, rank, world_size, timeout)

    def accumulate(self, x: Tensor) -> Tensor:
        """``x`` in the dtype row-parallel partial sums are made and summed in: fp32 on CPU
        (the CPU kernels take fp32 activations as they take bf16, and quantise the same
        values), the activation dtype on CUDA (NCCL sums bf16 natively)."""
        return x.float() if self.device.type == "cpu" else x

    def all_reduce(self, partial: Tensor) -> Tensor:
        """The sum of every rank's ``partial`` (same shape and dtype everywhere), in place."""
        total = partial.contiguous()
        self._pg.allreduce([total]).wait()
        return total

    def all_gather_columns(self, local: Tensor, widths: list[int]) -> Tensor:
        """(N, widths[rank]) per rank -> (N, sum(widths)): rank order, padded to the widest
        run for the collective (gloo and NCCL gather equal shapes)."""
        widest = max(widths)
        rows = local.shape[0]
        padded = local if local.shape[1] == widest else torch.nn.functional.pad(local, (0, widest - local.shape[1]))
        parts = [torch.empty(rows, widest, dtype=local.dtype, device=local.device) for _ in widths]
        self._pg.allgather([parts], [padded.contiguous()]).wait()
        return torch.cat([p[:, :w] for p, w in zip(parts, widths, strict=True)], dim=1)
