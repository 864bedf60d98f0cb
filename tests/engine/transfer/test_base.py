"""KVSender's wait/abort logic, with a fake transport at the backend seam."""

import threading

import pytest
import torch

from flashpd.engine.transfer import GroupSpec, KVSender, LocalReceiver, TransferContract, TransferError, TransferTimeout
from flashpd.engine.transfer.base import MAX_POLL_SLEEP_S, MIN_POLL_SLEEP_S, SPIN_S, TransferCancelled, poll_sleep_s

CONTRACT = TransferContract("tiny", (GroupSpec("main.L2", 16, "nvfp4_e4m3x16"),))


class ScriptedSender(KVSender):
    """Reports the scripted states in order for every poll, records aborts."""

    backend = "local"

    def __init__(self, states: list[str]):
        super().__init__(CONTRACT, {"main.L2": torch.zeros(4, 16, dtype=torch.uint8)})
        self.states = states
        self.aborted: list[object] = []

    def _attach(self, peer):
        self.attached = peer.agent_name

    def _detach(self, peer):
        self.attached = None

    def _post(self, peer, runs, notice, trace):
        return {"notice": notice}

    def _poll(self, xfer):
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    def _abort(self, xfer):
        self.aborted.append(xfer)

    def _notify(self, peer, notice):
        self.notified = notice

    def close(self):
        self._peers.clear()


@pytest.fixture
def receiver():
    r = LocalReceiver(CONTRACT, {"main.L2": torch.zeros(4, 16, dtype=torch.uint8)}, "decode-1")
    yield r
    r.close()


def test_wait_times_out_and_aborts_a_stuck_transfer(receiver):
    sender = ScriptedSender(["PROC"])
    sender.connect(receiver.descriptor())
    handle = sender.send("r", [0], [1], "p")
    with pytest.raises(TransferTimeout):
        sender.wait(handle, timeout_s=0.05)
    assert sender.aborted == [handle.xfer]
    with pytest.raises(TransferError, match="aborted"):
        sender.wait(handle, timeout_s=1)


def test_wait_raises_on_transport_error(receiver):
    sender = ScriptedSender(["PROC", "ERR"])
    sender.connect(receiver.descriptor())
    with pytest.raises(TransferError, match="failed"):
        sender.wait(sender.send("r", [0], [1], "p"), timeout_s=5)


def test_wait_reports_bytes_and_abort_after_completion_is_a_no_op(receiver):
    sender = ScriptedSender(["PROC", "PROC", "DONE"])
    sender.connect(receiver.descriptor())
    handle = sender.send("r", [0, 1], [2, 3], "p")
    stats = sender.wait(handle, timeout_s=5)
    assert stats.num_bytes == 32 and stats.seconds > 0
    sender.abort(handle)
    assert sender.aborted == [] and sender.wait(handle, timeout_s=5) is stats


def test_wait_aborts_when_cancelled(receiver):
    import threading

    sender = ScriptedSender(["PROC"])
    sender.connect(receiver.descriptor())
    handle = sender.send("r", [0], [1], "decode-1")
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(TransferCancelled):
        sender.wait(handle, timeout_s=60.0, cancel=cancel)
    assert sender.aborted == [handle.xfer] and handle.aborted


def test_a_failed_abort_is_recorded_so_no_abandon_follows(receiver):
    import threading

    class Uncancellable(ScriptedSender):
        def _abort(self, xfer):
            raise TransferError("cannot cancel an RDMA write in flight")

    sender = Uncancellable(["PROC"])
    sender.connect(receiver.descriptor())
    handle = sender.send("r", [0], [1], "decode-1")
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(TransferError, match="cannot cancel"):
        sender.wait(handle, timeout_s=60.0, cancel=cancel)
    assert handle.abort_failed


def test_wait_records_where_the_push_went(receiver):
    sender = ScriptedSender(["PROC", "PROC", "DONE"])
    sender.connect(receiver.descriptor())
    handle = sender.send("r", [0, 1], [2, 3], "p")
    sender.wait(handle, timeout_s=5)
    assert handle.trace["polls"] == 3
    assert {"check_ms", "notice_ms", "done_ms"} <= set(handle.trace)
    assert all(v >= 0 for v in handle.trace.values())
    # the posting thread's own account: CPU time and context switches, in send and to the end
    usage = {f"{p}_{k}" for p in ("send", "done") for k in ("cpu_ms", "vcsw", "ivcsw")}
    assert usage <= set(handle.trace)


def test_completion_seen_by_another_thread_leaves_out_the_posting_threads_usage(receiver):
    sender = ScriptedSender(["DONE"])
    sender.connect(receiver.descriptor())
    handle = sender.send("r", [0], [1], "p")
    waiter = threading.Thread(target=sender.wait, args=(handle, 5))
    waiter.start()
    waiter.join()
    assert handle.stats is not None and "done_ms" in handle.trace
    assert "send_cpu_ms" in handle.trace and "done_cpu_ms" not in handle.trace


def test_polls_spin_while_a_push_is_young_then_back_off_in_proportion():
    """A sub-millisecond push (a 128K-token prompt over cuda_ipc) is seen without sleeping;
    a slow one within 1/8 of its time, never more than a millisecond late."""
    assert poll_sleep_s(0.0) == 0.0 and poll_sleep_s(SPIN_S / 2) == 0.0
    assert poll_sleep_s(SPIN_S) == max(SPIN_S / 8, MIN_POLL_SLEEP_S)
    assert poll_sleep_s(4e-3) == 5e-4
    assert poll_sleep_s(60.0) == MAX_POLL_SLEEP_S == 1e-3
