"""In-process transfer backend: copies between two pool sets of one process.

For unit tests and single-process serving. The receiver registers itself under its agent name in
a process-wide registry (that registry plays the role of NIXL's memory registration); the
descriptor names the process, so a descriptor carried to another process fails at connect.
Semantics match the NIXL backend: the bytes land first, then the notice decides whether the
receiver counts them (a late write after cancel lands in the blocks but is rejected).
"""

from __future__ import annotations

import os
import queue
import uuid
import weakref

import torch

from flashpd.engine.transfer.base import BlockRuns, KVPools, KVReceiver, KVSender, TransferError
from flashpd.engine.transfer.contract import TransferContract
from flashpd.engine.transfer.wire import PeerDescriptor

_RECEIVERS: weakref.WeakValueDictionary[str, LocalReceiver] = weakref.WeakValueDictionary()


class LocalReceiver(KVReceiver):
    backend = "local"

    def __init__(self, contract: TransferContract, pools: KVPools, incarnation: str, agent_name: str | None = None):
        super().__init__(contract, pools, incarnation, agent_name or f"flashpd-local-{uuid.uuid4().hex[:12]}")
        if self.agent_name in _RECEIVERS:
            raise ValueError(f"a local receiver named {self.agent_name!r} already exists")
        self._inbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        _RECEIVERS[self.agent_name] = self

    def deliver(self, notice: bytes) -> None:
        """Called by a LocalSender after its copy (any thread)."""
        self._inbox.put(notice)

    def _agent_metadata(self) -> bytes:
        return str(os.getpid()).encode()  # the process whose memory the regions name

    def _fetch_notices(self) -> list[bytes]:
        notices = []
        while not self._inbox.empty():
            notices.append(self._inbox.get_nowait())
        return notices

    def close(self) -> None:
        if _RECEIVERS.get(self.agent_name) is self:
            del _RECEIVERS[self.agent_name]


class LocalSender(KVSender):
    """Copies synchronously inside `send`; `wait` then returns at once."""

    backend = "local"

    def __init__(self, contract: TransferContract, pools: KVPools):
        super().__init__(contract, pools)
        self._receivers: dict[str, LocalReceiver] = {}

    def _attach(self, peer: PeerDescriptor) -> None:
        if peer.agent_metadata != str(os.getpid()).encode():
            raise TransferError(f"local peer {peer.agent_name} lives in another process")
        receiver = _RECEIVERS.get(peer.agent_name)
        if receiver is None or receiver.incarnation != peer.incarnation:
            raise TransferError(f"no live local receiver {peer.agent_name} (incarnation {peer.incarnation})")
        self._receivers[peer.agent_name] = receiver

    def _detach(self, peer: PeerDescriptor) -> None:
        del self._receivers[peer.agent_name]

    def _post(self, peer: PeerDescriptor, runs: BlockRuns, notice: bytes, trace: dict[str, float]) -> str:
        receiver = self._receivers[peer.agent_name]
        if _RECEIVERS.get(peer.agent_name) is not receiver:
            raise TransferError(f"local receiver {peer.agent_name} was closed")
        for name, src_pool in self.pools.items():
            dst_pool = receiver.pools[name]  # [num_blocks, block_bytes]
            src_idx = torch.from_numpy(runs.src).to(src_pool.device)
            dst_idx = torch.from_numpy(runs.dst).to(dst_pool.device)
            rows = src_pool.index_select(0, src_idx).to(dst_pool.device)  # [n, block_bytes]
            dst_pool.index_copy_(0, dst_idx, rows)
        receiver.deliver(notice)
        return "DONE"

    def _poll(self, xfer: str) -> str:
        return xfer

    def _abort(self, xfer: str) -> None:
        # Unreachable through KVSender.abort (it aborts only in-progress xfers): a local xfer
        # is complete when _post returns.
        raise TransferError(f"local transfer in state {xfer} cannot be aborted")

    def _notify(self, peer: PeerDescriptor, notice: bytes) -> None:
        receiver = self._receivers[peer.agent_name]
        if _RECEIVERS.get(peer.agent_name) is not receiver:
            raise TransferError(f"local receiver {peer.agent_name} was closed")
        receiver.deliver(notice)

    def close(self) -> None:
        self._receivers.clear()
        self._peers.clear()
