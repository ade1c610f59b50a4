"""The ranks' process group: gloo on CPU, NCCL on CUDA, rendezvous through a TCP store on
loopback; the two collectives a sharded forward pass needs.

Every socket of the group is on loopback, since the ranks are processes of one host and
nothing else has business joining them: the store listens on a socket rank 0 bound to
127.0.0.1 itself (given a host, ``TCPStore`` binds every interface, ``[::]``), gloo is told
its address instead of picking one from the hostname, and NCCL's bootstrap sockets are put
on ``lo`` (``NCCL_SOCKET_IFNAME``, unless the operator set it). The store has no secret: any
local process could reach it, as it could reach the ranks themselves.

The group is built from torch's process-group classes directly rather than
``init_process_group``: no process-global default group, so one process can hold several
engines (tests build TP=2 and TP=3 engines one after the other), and every collective carries
the group's timeout (a rank that died or hangs fails the step within ``timeout_s`` instead of
blocking it for ever).
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["RENDEZVOUS_HOST", "TensorParallelGroup", "rendezvous_listener"]

#: Longest wait for every rank to join the group.
_RENDEZVOUS_TIMEOUT_S = 300.0
#: Where the store listens and the ranks' collectives connect (see the module docstring).
RENDEZVOUS_HOST = "127.0.0.1"
_NCCL_LOOPBACK = "lo"


def rendezvous_listener() -> socket.socket:
    """The store's listening socket, on loopback and a free port: rank 0 opens it before it
    starts the other ranks, so that no other process can take the port in between and pose
    as the store."""
    return socket.create_server((RENDEZVOUS_HOST, 0), backlog=128)


class TensorParallelGroup:
    """``world_size`` ranks summing and gathering activations; ``rank`` is this process's."""

    def __init__(
        self, *, rank: int, world_size: int, port: int, device: str, timeout_s: float,
        listener: socket.socket | None = None,
    ) -> None:
        """``listener``: rank 0's :func:`rendezvous_listener` on ``port``, which its store takes
        over (the other ranks connect to ``port``)."""
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        # Meeting waits for every rank to start (a Python and torch import each: seconds on a
        # busy machine), however short the collectives' timeout.
        meet = datetime.timedelta(seconds=max(timeout_s, _RENDEZVOUS_TIMEOUT_S))
        self._store = self._open_store(rank, world_size, port, meet, listener)
        if self.device.type == "cuda":
            os.environ.setdefault("NCCL_SOCKET_IFNAME", _NCCL_LOOPBACK)
            torch.cuda.set_device(self.device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._pg: Any = dist.ProcessGroupNCCL(self._store, rank, world_size, options)
        else:
            # The binding is ``_Options`` (torch's stubs still call it ``Options``).
            gloo = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            gloo._timeout = timeout
            gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=RENDEZVOUS_HOST)]
            self._pg = dist.ProcessGroupGloo(self._store, rank, world_size, gloo)

    @staticmethod
    def _open_store(
        rank: int, world_size: int, port: int, timeout: datetime.timedelta, listener: socket.socket | None
    ) -> dist.TCPStore:
        assert (listener is not None) == (rank == 0), "rank 0, and only rank 0, holds the store's socket"
        if listener is None:
            return dist.TCPStore(RENDEZVOUS_HOST, port, world_size, is_master=False, timeout=timeout)
        # The store owns the descriptor from here on (it closes it).
        fd = listener.detach()
        return dist.TCPStore(RENDEZVOUS_HOST, port, world_size, is_master=True, timeout=timeout, master_listen_fd=fd)

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
