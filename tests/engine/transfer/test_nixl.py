"""NIXL backend between two processes over loopback: the receiver runs in a spawned child.

The child serves a small command protocol over a pipe and polls its receiver between commands
(without a NIXL progress thread, the receiver's polling is what progresses UCX on its side).
"""

import multiprocessing as mp
import time

import pytest
import torch

pytest.importorskip("nixl")

from flashpd.engine.transfer import ContractMismatch, GroupSpec, TransferContract, TransferError  # noqa: E402
from flashpd.engine.transfer.nixl_backend import NixlSender  # noqa: E402
from flashpd.engine.transfer.remote_receiver import receiver_main  # noqa: E402

pytestmark = pytest.mark.net

CONTRACT = TransferContract(
    "tiny", (GroupSpec("main.L2", 256, "nvfp4_e4m3x16"), GroupSpec("index.L2", 64, "mxfp4_ue8m0x32"))
)
RECEIVER_BLOCKS = 16
REPLY_TIMEOUT_S = 60.0


class Peer:
    """The parent's end of the child receiver."""

    def __init__(self, conn, process):
        self.conn, self.process = conn, process

    def call(self, *command):
        self.conn.send(command)
        assert self.conn.poll(REPLY_TIMEOUT_S), f"receiver did not answer {command[0]}"
        reply = self.conn.recv()
        if isinstance(reply, Exception):
            raise reply
        return reply

    def wait_for(self, command: str, ready, timeout_s: float = 10.0):
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.call(command)
            if ready(value) or time.monotonic() > deadline:
                return value
            time.sleep(0.01)


@pytest.fixture(scope="module")
def peer():
    with pytest.MonkeyPatch.context() as env:
        env.setenv("UCX_NET_DEVICES", "lo")
        env.setenv("NIXL_LOG_LEVEL", "WARN")
        ctx = mp.get_context("spawn")
        parent_end, child_end = ctx.Pipe()
        process = ctx.Process(
            target=receiver_main, daemon=True, args=(child_end, CONTRACT.to_json(), RECEIVER_BLOCKS, "decode-1")
        )
        process.start()
        assert parent_end.poll(REPLY_TIMEOUT_S), "receiver process did not start"
        the_peer = Peer(parent_end, process)
        the_peer.descriptor = parent_end.recv()
        yield the_peer
        parent_end.send(("stop",))
        process.join(timeout=20)
        if process.is_alive():
            process.kill()


@pytest.fixture(scope="module")
def sender(peer):
    gen = torch.Generator().manual_seed(0)
    pools = {
        g.name: torch.randint(0, 256, (8, g.block_bytes), dtype=torch.uint8, generator=gen) for g in CONTRACT.groups
    }
    the_sender = NixlSender(CONTRACT, pools)
    the_sender.connect(peer.descriptor)
    yield the_sender
    the_sender.close()


def test_bytes_move_between_processes_and_receiver_sees_completion(peer, sender):
    src, dst = [5, 0, 1, 2], [13, 3, 4, 5]
    peer.call("expect", "r1", dst, 60.0, "prefill-1")
    stats = sender.wait(sender.send("r1", src, dst, "prefill-1"), timeout_s=30)
    assert stats.num_bytes == 4 * (256 + 64) and stats.seconds > 0
    assert peer.wait_for("completed", lambda done: done) == ["r1"]
    for name in CONTRACT.group_names:
        assert torch.equal(peer.call("rows", name, dst), sender.pools[name][src])
        assert int(peer.call("rows", name, [0, 1, 2, 15]).sum()) == 0


def test_late_write_after_cancel_is_rejected(peer, sender):
    peer.call("expect", "r2", [7, 8], 60.0, "prefill-1")
    assert peer.call("cancel", "r2") is True
    sender.wait(sender.send("r2", [6, 7], [7, 8], "prefill-1"), timeout_s=30)
    counts = peer.wait_for("rejections", lambda c: c.get("cancelled", 0) >= 1)
    assert counts.get("cancelled") == 1
    assert peer.call("completed") == []


def test_contract_mismatch_fails_at_connect(peer):
    other = TransferContract(
        "tiny", (GroupSpec("main.L2", 128, "nvfp4_e4m3x16"), GroupSpec("index.L2", 64, "mxfp4_ue8m0x32"))
    )
    pools = {g.name: torch.zeros(2, g.block_bytes, dtype=torch.uint8) for g in other.groups}
    mismatched = NixlSender(other, pools)
    with pytest.raises(ContractMismatch, match=r"groups\[main.L2\].block_bytes"):
        mismatched.connect(peer.descriptor)
    assert mismatched.peers == ()
    mismatched.close()


def test_abandon_notice_quiets_a_drained_request(peer, sender):
    peer.call("expect", "r3", [9, 10], 60.0, "prefill-3")
    assert peer.call("drain", "r3", 600.0) == "prefill-3"  # a write could still come
    sender.abandon("r3", "prefill-3")  # the sender gave it up: nothing in flight
    assert peer.wait_for("quiet", lambda q: q) == ["prefill-3"]


def test_completion_notice_quiets_a_request_drained_while_its_write_was_in_flight(peer, sender):
    peer.call("expect", "r4", [11], 60.0, "prefill-4")
    assert peer.call("drain", "r4", 600.0) == "prefill-4"
    sender.wait(sender.send("r4", [1], [11], "prefill-4"), timeout_s=30)
    assert peer.wait_for("quiet", lambda q: q) == ["prefill-4"]


def test_concurrent_pushes_from_many_threads_all_complete(peer, sender):
    """Posts, polls and notices from 8 threads at once on one NIXL agent (a cancel storm or 48
    concurrent streams did this and crashed in uct_cma_ep_tx before agent calls were
    serialized), some of them cancelled mid-wait; then a plain push still completes."""
    import threading

    rounds, threads = 25, 8
    errors: list[BaseException] = []

    def pusher(t: int):
        try:
            for i in range(rounds):
                cancel = threading.Event()
                if (t + i) % 3 == 0:
                    cancel.set()
                handle = sender.send(f"t{t}.{i}", [t % 8], [t], f"p{t}")
                try:
                    sender.wait(handle, timeout_s=30, cancel=cancel)
                except TransferError:
                    assert cancel.is_set()
                if cancel.is_set():
                    sender.abandon(f"t{t}.{i}", f"p{t}")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=pusher, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert not errors and not any(w.is_alive() for w in workers)
    peer.call("expect", "after", [12, 13], 60.0, "prefill-after")
    sender.wait(sender.send("after", [2, 3], [12, 13], "prefill-after"), timeout_s=30)
    assert "after" in peer.wait_for("completed", lambda done: "after" in done)


def test_a_write_completes_while_the_receivers_owner_is_not_polling(peer, sender):
    """The sender's WRITE completes only once the receiver's UCX worker progresses; a decode
    engine polls once per loop iteration (a whole step when busy). The receiver's own progress
    thread completes the write while its owner is blocked, and keeps the notice for the
    owner's next poll."""
    src, dst = [1, 2], [9, 10]
    peer.call("expect", "r-blocked", dst, 60.0, "prefill-1")
    peer.conn.send(("block",))  # the child owner now waits on its pipe without polling
    stats = sender.wait(sender.send("r-blocked", src, dst, "prefill-1"), timeout_s=30)
    assert stats.num_bytes == 2 * (256 + 64)
    peer.conn.send(("unblock",))
    assert peer.conn.poll(REPLY_TIMEOUT_S)
    assert peer.conn.recv() > 0  # the progress thread's pumps
    assert peer.wait_for("completed", lambda done: done) == ["r-blocked"]
    for name in CONTRACT.group_names:
        assert torch.equal(peer.call("rows", name, dst), sender.pools[name][src])


def test_a_write_prepared_ahead_moves_nothing_until_posted_then_the_same_bytes(peer, sender):
    """prepare builds the descriptors and NIXL's request (what a prefill worker does while its
    last chunk computes); nothing lands before `post`, then the bytes and the notice do."""
    src, dst = [3, 4], [9, 10]
    before = {name: peer.call("rows", name, dst) for name in CONTRACT.group_names}
    assert not any(torch.equal(before[name], sender.pools[name][src]) for name in CONTRACT.group_names)
    peer.call("expect", "r-prep", dst, 60.0, "prefill-1")
    prepared = sender.prepare("r-prep", src, dst, "prefill-1")
    time.sleep(0.2)
    assert peer.call("completed") == []
    for name in CONTRACT.group_names:
        assert torch.equal(peer.call("rows", name, dst), before[name])
    handle = sender.post(prepared)
    stats = sender.wait(handle, timeout_s=30)
    assert stats.num_bytes == 2 * (256 + 64)
    assert peer.wait_for("completed", lambda done: done) == ["r-prep"]
    for name in CONTRACT.group_names:
        assert torch.equal(peer.call("rows", name, dst), sender.pools[name][src])
    assert {"descriptors_ms", "nixl_init_ms", "nixl_post_ms", "prepare_cpu_ms"} <= set(handle.trace)
    with pytest.raises(TransferError, match="already posted"):
        sender.post(prepared)
    sender.discard(prepared)  # after the post: a no-op


def test_a_discarded_prepared_write_releases_its_request_and_never_lands(peer, sender):
    dst = [11, 12]
    peer.call("expect", "r-drop", dst, 60.0, "prefill-1")
    prepared = sender.prepare("r-drop", [1, 2], dst, "prefill-1")
    sender.discard(prepared)
    sender.discard(prepared)  # idempotent
    with pytest.raises(TransferError, match="already posted or discarded"):
        sender.post(prepared)
    time.sleep(0.2)
    assert peer.call("completed") == []
    assert peer.call("cancel", "r-drop") is True  # nothing ever arrived for it


def test_close_releases_a_prepared_write_that_was_never_posted(peer):
    pools = {g.name: torch.zeros(4, g.block_bytes, dtype=torch.uint8) for g in CONTRACT.groups}
    own = NixlSender(CONTRACT, pools)
    own.connect(peer.descriptor)
    prepared = own.prepare("r-closed", [0], [14], "prefill-1")
    own.close()
    with pytest.raises(TransferError, match="closed"):
        own.post(prepared)
