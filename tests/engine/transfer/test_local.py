import time

import pytest
import torch

from flashpd.engine.transfer import GroupSpec, LocalReceiver, LocalSender, TransferContract, TransferError
from flashpd.engine.transfer.wire import PeerDescriptor

CONTRACT = TransferContract(
    "tiny",
    (
        GroupSpec("main.L2", 24, "nvfp4_e4m3x16"),
        GroupSpec("index.L2", 8, "mxfp4_ue8m0x32"),
        GroupSpec("main.L4", 48, "nvfp4_e4m3x16"),
    ),
)


def random_pools(num_blocks: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        g.name: torch.randint(0, 256, (num_blocks, g.block_bytes), dtype=torch.uint8, generator=gen)
        for g in CONTRACT.groups
    }


def zero_pools(num_blocks: int) -> dict[str, torch.Tensor]:
    return {g.name: torch.zeros(num_blocks, g.block_bytes, dtype=torch.uint8) for g in CONTRACT.groups}


@pytest.fixture
def pair():
    receiver = LocalReceiver(CONTRACT, zero_pools(12), "decode-1")
    sender = LocalSender(CONTRACT, random_pools(10, seed=1))
    sender.connect(receiver.descriptor())
    yield sender, receiver
    receiver.close()


def lease() -> float:
    return time.monotonic() + 60


def test_scattered_blocks_are_copied_exactly(pair):
    sender, receiver = pair
    src, dst = [7, 0, 3, 9], [11, 2, 5, 3]
    receiver.expect("r1", dst, lease(), "prefill-1")
    stats = sender.wait(sender.send("r1", src, dst, "prefill-1"), timeout_s=5)
    assert stats.num_bytes == 4 * (24 + 8 + 48)
    assert receiver.poll_completed() == ["r1"]
    untouched = [b for b in range(12) if b not in dst]
    for name in CONTRACT.group_names:
        assert torch.equal(receiver.pools[name][dst], sender.pools[name][src])
        assert int(receiver.pools[name][untouched].sum()) == 0


def test_request_completes_after_its_last_chunk_send(pair):
    sender, receiver = pair
    receiver.expect("r1", [4, 5, 6], lease(), "prefill-1")
    sender.wait(sender.send("r1", [0, 1], [4, 5], "prefill-1"), timeout_s=5)
    assert receiver.poll_completed() == []
    sender.wait(sender.send("r1", [2], [6], "prefill-1"), timeout_s=5)
    assert receiver.poll_completed() == ["r1"]


def test_late_write_after_cancel_is_rejected(pair):
    sender, receiver = pair
    receiver.expect("r1", [1, 2], lease(), "prefill-1")
    assert receiver.cancel("r1")
    sender.wait(sender.send("r1", [3, 4], [1, 2], "prefill-1"), timeout_s=5)
    assert receiver.poll_completed() == []
    assert receiver.rejection_counts() == {"cancelled": 1}
    assert receiver.live_request_ids == ()


def test_write_from_superseded_incarnation_is_rejected(pair):
    sender, receiver = pair
    receiver.expect("r1", [1, 2], lease(), "prefill-old")
    receiver.expect("r1", [1, 2], lease(), "prefill-new")
    sender.wait(sender.send("r1", [3, 4], [1, 2], "prefill-old"), timeout_s=5)
    assert receiver.poll_completed() == []
    sender.wait(sender.send("r1", [3, 4], [1, 2], "prefill-new"), timeout_s=5)
    assert receiver.poll_completed() == ["r1"]
    assert receiver.rejection_counts() == {"stale_incarnation": 1}


def test_expire_returns_requests_whose_lease_passed(pair):
    sender, receiver = pair
    now = time.monotonic()
    receiver.expect("slow", [1], now + 1.0, "prefill-1")
    receiver.expect("done", [2], now + 1.0, "prefill-1")
    sender.wait(sender.send("done", [0], [2], "prefill-1"), timeout_s=5)
    assert receiver.expire(now + 0.5) == []
    assert receiver.expire(now + 1.0) == ["slow"]
    assert receiver.poll_completed() == ["done"]
    sender.wait(sender.send("slow", [0], [1], "prefill-1"), timeout_s=5)
    assert receiver.rejection_counts() == {"expired": 1}


def test_send_rejects_bad_block_lists(pair):
    sender, _ = pair
    with pytest.raises(ValueError, match="outside the peer"):
        sender.send("r", [0], [12], "p")
    with pytest.raises(ValueError, match="src_block_ids outside"):
        sender.send("r", [10], [0], "p")
    with pytest.raises(ValueError, match="duplicate"):
        sender.send("r", [0, 1], [3, 3], "p")
    with pytest.raises(ValueError, match="duplicate"):  # not sorted: the full duplicate search
        sender.send("r", [2, 0, 1], [3, 1, 3], "p")
    with pytest.raises(ValueError, match="outside the peer"):  # not sorted: the full min / max
        sender.send("r", [0, 1, 2], [3, -1, 2], "p")
    with pytest.raises(ValueError, match="equal, non-empty"):
        sender.send("r", [0, 1], [3], "p")


def test_send_needs_a_peer_name_with_several_connections(pair):
    sender, receiver = pair
    second = LocalReceiver(CONTRACT, zero_pools(4), "decode-2")
    peer = sender.connect(second.descriptor())
    with pytest.raises(TransferError, match="peer="):
        sender.send("r", [0], [0], "p")
    second.expect("r", [3], lease(), "p")
    sender.wait(sender.send("r", [5], [3], "p", peer=peer), timeout_s=5)
    assert second.poll_completed() == ["r"] and receiver.poll_completed() == []
    assert sender.peer_incarnation(peer) == "decode-2"
    second.close()


def test_descriptor_from_another_process_is_refused(pair):
    _, receiver = pair
    desc = PeerDescriptor.from_bytes(receiver.descriptor())
    foreign = PeerDescriptor(
        desc.backend, desc.agent_name, desc.incarnation, desc.contract, desc.regions, agent_metadata=b"999999999"
    )
    sender = LocalSender(CONTRACT, random_pools(2, seed=2))
    with pytest.raises(TransferError, match="another process"):
        sender.connect(foreign.to_bytes())
