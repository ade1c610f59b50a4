"""The KV transports (shared memory, TCP) on synthetic blocks: round trips, a sender killed
mid-transfer (the receiver fails clearly, no segment is left), unclaimed transfers dropped."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from core_engine.kv_transfer import (
    KVTransferConfig,
    KVTransferError,
    KVTransferMeta,
    KVTransferTimeout,
    PrefilledKV,
    open_receiver,
    open_sender,
)
from core_engine.kv_transfer.shm import segment_name, unlink_orphans

_REPO = Path(__file__).resolve().parents[2]
_SHM = Path("/dev/shm")


def make_kv(num_blocks: int = 3, *, quantized: bool = False, seed: int = 0) -> PrefilledKV:
    """Blocks shaped like SmolLM2's (30 layers, 3 kv heads, head_dim 64), random values."""
    gen = torch.Generator().manual_seed(seed)
    block_shape = (30, 2, 16, 3, 64)
    if quantized:
        data = torch.randint(-127, 128, (num_blocks, *block_shape), generator=gen, dtype=torch.int8)
        scales = torch.rand((num_blocks, 30, 2, 3), generator=gen)
    else:
        data, scales = torch.randn((num_blocks, *block_shape), generator=gen), None
    meta = KVTransferMeta(
        prompt_token_ids=list(range(16 * num_blocks - 5)), first_token_id=7,
        block_hashes=[bytes([i]) * 16 for i in range(num_blocks - 1)], num_blocks=num_blocks,
        layout="test", block_shape=block_shape, dtype=str(data.dtype),
        scale_shape=None if scales is None else (30, 2, 3),
        data_nbytes=data.numel() * data.element_size(), scales_nbytes=0 if scales is None else scales.numel() * 4,
    )
    return PrefilledKV(meta=meta, data=data, scales=scales)


def _segments() -> set[str]:
    return {p.name for p in _SHM.glob("ikv-*")} if _SHM.is_dir() else set()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(params=["shm", "tcp"])
def config(request: pytest.FixtureRequest) -> KVTransferConfig:
    if request.param == "tcp":
        return KVTransferConfig(transport="tcp", address=f"tcp://127.0.0.1:{_free_port()}", timeout_s=10)
    return KVTransferConfig(transport="shm", timeout_s=10)


@pytest.fixture(autouse=True)
def no_segments_left() -> Iterator[None]:
    before = _segments()
    yield
    assert _segments() <= before, "a shared-memory segment was left behind"


@pytest.mark.parametrize("quantized", [False, True])
def test_round_trip_gives_the_same_blocks(config: KVTransferConfig, quantized: bool) -> None:
    receiver = open_receiver(config)
    sender = open_sender(config)
    try:
        sent = {f"t{i}": make_kv(1 + i, quantized=quantized, seed=i) for i in range(3)}
        for transfer_id, kv in sent.items():
            sender.send(transfer_id, kv)
        for transfer_id in reversed(list(sent)):  # claimed in any order
            got = receiver.receive(transfer_id)
            kv = sent[transfer_id]
            assert got.meta == kv.meta
            assert torch.equal(got.data, kv.data)
            assert (got.scales is None) == (kv.scales is None)
            if kv.scales is not None:
                assert torch.equal(got.scales, kv.scales)
    finally:
        sender.close()
        receiver.close()


def test_a_transfer_never_sent_times_out(config: KVTransferConfig) -> None:
    receiver = open_receiver(config)
    try:
        with pytest.raises(KVTransferTimeout, match="'nobody-sends-this': nothing"):
            receiver.receive("nobody-sends-this", timeout=0.3)
    finally:
        receiver.close()


def test_unclaimed_transfers_are_dropped(config: KVTransferConfig) -> None:
    config = KVTransferConfig(transport=config.transport, address=config.address, ttl_s=0.2)
    receiver = open_receiver(config)
    sender = open_sender(config)
    try:
        sender.send("unclaimed", make_kv())
        time.sleep(0.5)
        sender.send("claimed", make_kv(seed=1))  # the shm sender expires old segments as it sends
        assert receiver.receive("claimed", timeout=2).meta.num_blocks == 3
        with pytest.raises(KVTransferTimeout):
            receiver.receive("unclaimed", timeout=0.2)
    finally:
        sender.close()
        receiver.close()


_CHILD = textwrap.dedent(
    """
    import sys
    from core_engine.kv_transfer import KVTransferConfig, open_sender
    from tests.core_engine.test_kv_transfer import make_kv
    config = KVTransferConfig(transport=sys.argv[1], address=sys.argv[2] or None)
    sender = open_sender(config)
    kv = make_kv(64)  # ~24 MiB
    print("sending", flush=True)
    sender.send("killed-mid-transfer", kv)
    print("sent", flush=True)
    """
)


def _sender_killed_mid_transfer(config: KVTransferConfig, flag: Path) -> None:
    flag.touch()
    env = dict(os.environ, PYTHONPATH=str(_REPO), INFERMUX_TEST_KV_SEND_STALL=str(flag))
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, config.transport, config.address or ""],
        env=env, cwd=_REPO, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "sending"
        if config.transport == "shm":
            deadline = time.monotonic() + 30
            while segment_name("killed-mid-transfer") not in _segments():
                assert time.monotonic() < deadline, "the child never created its segment"
                time.sleep(0.01)
        time.sleep(0.5)  # inside the stall: half of the blocks written / the first frames sent
        assert not (tmp_flag := Path(env["INFERMUX_TEST_KV_SEND_STALL"])).exists(), tmp_flag
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()


def test_sender_killed_mid_transfer_fails_the_receive_and_leaves_nothing(
    config: KVTransferConfig, tmp_path: Path
) -> None:
    receiver = open_receiver(config)
    try:
        _sender_killed_mid_transfer(config, tmp_path / "stall")
        with pytest.raises(KVTransferError) as raised:
            receiver.receive("killed-mid-transfer", timeout=2.0)
        if config.transport == "shm":  # a dead sender is seen as such, not as a timeout
            assert not isinstance(raised.value, KVTransferTimeout), raised.value
        assert segment_name("killed-mid-transfer") not in _segments()
        # The transport still carries the next transfer (a retried request).
        sender = open_sender(config)
        try:
            sender.send("retried", make_kv(seed=3))
            assert torch.equal(receiver.receive("retried").data, make_kv(seed=3).data)
        finally:
            sender.close()
    finally:
        receiver.close()


def test_a_dead_senders_segment_nobody_waits_for_is_swept(tmp_path: Path) -> None:
    config = KVTransferConfig(transport="shm")
    _sender_killed_mid_transfer(config, tmp_path / "stall")
    assert segment_name("killed-mid-transfer") in _segments()
    assert segment_name("killed-mid-transfer") in unlink_orphans()
    assert segment_name("killed-mid-transfer") not in _segments()
