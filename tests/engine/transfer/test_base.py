"""KVSender's wait/abort logic, with a fake transport at the backend seam."""

import pytest
import torch

from flashpd.engine.transfer import GroupSpec, KVSender, LocalReceiver, TransferContract, TransferError, TransferTimeout
from flashpd.engine.transfer.base import TransferCancelled

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

    def _post(self, peer, src, dst, notice):
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
