"""A tensor-parallel rank other than 0: ``python -m core_engine.distributed.worker FD``.

Started by rank 0 (:class:`~core_engine.distributed.launcher.TensorParallelRanks`), never by
hand: ``FD`` is its end of a socket pair to rank 0. The rank joins the process group, loads
and shards the model, allocates its KV pool with rank 0's block count, then runs every step's
forward pass rank 0 sends (its collectives meet rank 0's and the other ranks'). It holds no
scheduler, sampler or request state: rank 0 decides everything.

It exits when rank 0 says stop, when its socket closes (the kernel closes rank 0's end when
that process dies, even by SIGKILL), and when a collective fails (another rank gone: the
group's timeout bounds the wait), so no rank outlives its engine. (Not ``PR_SET_PDEATHSIG``:
it fires when the *thread* that started the rank ends, and engines start from worker threads.)
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from multiprocessing.connection import Connection

__all__ = ["main"]

logger = logging.getLogger("core_engine.distributed.worker")


def serve(conn: Connection) -> None:
    """Run one rank until rank 0 stops it (see the module docstring)."""
    import torch

    from core_engine.distributed import messages as m
    from core_engine.distributed.launcher import load_rank_model
    from core_engine.model_runner import ModelRunner

    init = m.decoder.decode(conn.recv_bytes())
    assert isinstance(init, m.RankInit)
    if init.num_threads is not None and init.device == "cpu":
        torch.set_num_threads(init.num_threads)
    model, dtype, _ = load_rank_model(init.config, init.rank, init.world_size, init.port, init.device)
    conn.send_bytes(m.encoder.encode(m.Loaded(rank=init.rank, resident_bytes=model.resident_weight_bytes())))
    start = m.decoder.decode(conn.recv_bytes())
    if isinstance(start, m.Stop):
        return
    assert isinstance(start, m.StartRunner)
    config = init.config
    runner = ModelRunner(
        model, num_blocks=start.num_blocks, block_size=config.block_size, dtype=dtype,
        kv_cache_dtype=config.kv_cache_dtype, device=init.device,
    )
    conn.send_bytes(m.encoder.encode(m.Ready(rank=init.rank)))
    while True:
        message = m.decoder.decode(conn.recv_bytes())
        if isinstance(message, m.Stop):
            return
        assert isinstance(message, m.Step)
        runner.run_forward(message.batch)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [tensor-parallel rank, pid %(process)d] %(name)s: %(message)s")
    conn = Connection(socket.socket(fileno=int(args[0])).detach())
    try:
        serve(conn)
    except EOFError:  # rank 0 closed its end: the engine is gone
        return 0
    except Exception:
        logger.exception("tensor-parallel rank %s failed", os.getpid())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
