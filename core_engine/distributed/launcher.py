"""Rank 0's side of a tensor-parallel engine: it starts the other ranks, shares its config,
and sends each step's batch before running the step itself.

The engine that asked for ``tensor_parallel_size = N`` is rank 0 (its scheduler, sampler and
requests are the only ones). :meth:`TensorParallelRanks.start` starts ranks 1..N-1 as
``python -m core_engine.distributed.worker`` processes (no torchrun), each with one end of a
socket pair for control frames (:mod:`core_engine.distributed.messages`); the process group
meets on a TCP store on 127.0.0.1, whose socket rank 0 holds from the start (gloo on CPU, NCCL
on CUDA with rank ``r`` on ``cuda:r``; every socket of the group on loopback:
:mod:`core_engine.distributed.group`).

Failure is bounded: a rank that exits or hangs makes rank 0's next collective raise within
the group's timeout (``EngineConfig.tensor_parallel_timeout_s``), sending to a gone rank raises
at once, and :meth:`close` stops and then kills every rank. The engine then reports its loop
dead, and the backend above starts a fresh one.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from core_engine.config import EngineConfig, resolve_dtype
from core_engine.distributed import messages as m
from core_engine.distributed.group import RENDEZVOUS_HOST, TensorParallelGroup, rendezvous_listener
from core_engine.distributed.partition import partition
from core_engine.distributed.sharding import shard_model
from core_engine.model_runner import ForwardBatch

__all__ = ["TensorParallelRanks", "load_rank_model", "rank_device", "rank_threads"]

logger = logging.getLogger(__name__)

#: The project root (for ``-m core_engine.distributed.worker`` from a source checkout).
_ROOT = str(Path(__file__).resolve().parents[2])


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: ``cuda:rank`` (after the configured first GPU), else ``device``."""
    if not device.startswith("cuda"):
        return device
    first = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{first + rank}"


def rank_threads(config: EngineConfig) -> int | None:
    """torch threads per rank on CPU: the engine's threads shared out (at least one each)."""
    if not config.device.startswith("cpu"):
        return None
    total = config.num_threads or os.cpu_count() or 1
    return max(1, total // config.tensor_parallel_size)


def load_rank_model(
    config: EngineConfig, rank: int, world_size: int, port: int, device: str, listener: socket.socket | None = None
) -> tuple[Any, torch.dtype, Any]:
    """Join the group (rank 0: its store on ``listener``), load the GGUF and keep rank
    ``rank``'s shard, packed as ``config`` says: (model, compute dtype, tokenizer)."""
    from core_engine.gguf_loader import load_model
    from core_engine.weight_setup import pack_weights

    group = TensorParallelGroup(
        rank=rank, world_size=world_size, port=port, device=device, timeout_s=config.tensor_parallel_timeout_s,
        listener=listener,
    )
    dtype = resolve_dtype(config.dtype, config.device, config.weight_format)
    model, _, tokenizer = load_model(config.model_path, dtype=dtype, device=device, max_model_len=config.max_model_len)
    shards = partition(model.config, world_size)
    shard_model(model, shards[rank], group, [s.vocab[1] - s.vocab[0] for s in shards])
    pack_weights(model, config, tokenizer, budget=False)
    return model, dtype, tokenizer


class TensorParallelRanks:
    """Ranks 1..N-1 of an engine, seen from rank 0 (see the module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.world_size = config.tensor_parallel_size
        self._listener: socket.socket | None = rendezvous_listener()
        self.port: int = self._listener.getsockname()[1]
        self._procs: list[subprocess.Popen[bytes]] = []
        self._conns: list[Connection] = []
        self._closed = False

    @classmethod
    def start(cls, config: EngineConfig) -> tuple[TensorParallelRanks, Any, torch.dtype, Any]:
        """Start the other ranks, then load rank 0's shard alongside them: (ranks, model,
        dtype, tokenizer). ``RuntimeError`` naming the rank when one fails to start."""
        ranks = cls(config)
        try:
            ranks._spawn()
            listener, ranks._listener = ranks._listener, None  # the group's store takes it over
            model, dtype, tokenizer = load_rank_model(
                config, 0, ranks.world_size, ranks.port, rank_device(config.device, 0), listener
            )
            for rank, conn in enumerate(ranks._conns, start=1):
                ranks._expect(rank, conn, m.Loaded, config.tensor_parallel_timeout_s + 600)
        except BaseException:
            ranks.close()
            raise
        return ranks, model, dtype, tokenizer

    def _spawn(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
        threads = rank_threads(self.config)
        for rank in range(1, self.world_size):
            ours, theirs = socket.socketpair()
            proc = subprocess.Popen(
                [sys.executable, "-m", "core_engine.distributed.worker", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=env, cwd=_ROOT,
            )
            theirs.close()
            conn = Connection(ours.detach())
            self._procs.append(proc)
            self._conns.append(conn)
            conn.send_bytes(m.encoder.encode(m.RankInit(
                config=self.config, rank=rank, world_size=self.world_size, port=self.port,
                device=rank_device(self.config.device, rank), num_threads=threads,
            )))
        logger.info("tensor parallel: started ranks 1..%d (pids %s), group on %s:%d", self.world_size - 1,
                    ", ".join(str(p.pid) for p in self._procs), RENDEZVOUS_HOST, self.port)

    def _expect(self, rank: int, conn: Connection, kind: type, timeout_s: float) -> Any:
        """The next frame from ``rank``, which must be a ``kind``; waits while the rank lives."""
        proc = self._procs[rank - 1]
        deadline = time.monotonic() + timeout_s
        while not conn.poll(0.2):
            if proc.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited with status {proc.returncode} while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel rank {rank} did not answer within {timeout_s:.0f} s")
        try:
            message = m.decoder.decode(conn.recv_bytes())
        except EOFError:
            proc.wait(5)
            raise RuntimeError(f"tensor-parallel rank {rank} exited with status {proc.returncode} while starting") from None
        if not isinstance(message, kind):
            raise RuntimeError(f"tensor-parallel rank {rank} answered {type(message).__name__}, not {kind.__name__}")
        return message

    def start_runners(self, num_blocks: int) -> None:
        """Every rank allocates its KV pool of ``num_blocks`` blocks (rank 0's count)."""
        frame = m.encoder.encode(m.StartRunner(num_blocks=num_blocks))
        for conn in self._conns:
            conn.send_bytes(frame)
        for rank, conn in enumerate(self._conns, start=1):
            self._expect(rank, conn, m.Ready, 600)

    def send_step(self, batch: ForwardBatch) -> None:
        """Give every rank the step rank 0 is about to run (``RuntimeError`` for a rank gone)."""
        frame = m.encoder.encode(m.Step(batch=batch))
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send_bytes(frame)
            except OSError as exc:
                code = self._procs[rank - 1].poll()
                raise RuntimeError(f"tensor-parallel rank {rank} is gone (exit status {code}): {exc}") from exc

    def step_failed(self, exc: BaseException) -> RuntimeError:
        """The error a failed step raises: which rank was lost, or that one did not answer."""
        lost = None
        deadline = time.monotonic() + 1.0  # a killed rank is reaped a moment after its socket closes
        while lost is None and time.monotonic() < deadline:
            lost = self.lost()
            if lost is None:
                time.sleep(0.05)
        why = lost or f"a rank did not answer within {self.config.tensor_parallel_timeout_s:g} s"
        return RuntimeError(f"tensor-parallel step failed: {why} ({str(exc).splitlines()[0][:200]})")

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [p.pid for p in self._procs]

    def lost(self) -> str | None:
        """Which rank has exited, if any (``None``: all alive)."""
        for rank, proc in enumerate(self._procs, start=1):
            if proc.poll() is not None:
                code = proc.returncode
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"
                return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with {how}"
        return None

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop every rank (killed when it does not exit within ``timeout_s``). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._listener is not None:  # the group was never formed
            self._listener.close()
            self._listener = None
        stop = m.encoder.encode(m.Stop())
        for conn in self._conns:
            try:
                conn.send_bytes(stop)
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self._conns:
            conn.close()
