"""NIXL transfer backend (UCX): one-sided WRITEs of pool blocks plus a completion notification.

Each side runs one NIXL agent and registers its pools (DRAM on CPU hosts, VRAM on GPU hosts).
The receiver's descriptor carries its agent metadata; the sender loads it and prepares one
descriptor list per side with a row per (group, block):

    row(group g, block b) = g * num_blocks + b     -> (pool_g address + b * block_bytes_g)

so a send is just two index arrays into those lists. NIXL merges rows that are contiguous on
both sides into larger operations. The notice bytes ride as the transfer's notification, which
NIXL delivers to the receiver after the data.

Progress: by default no NIXL progress thread (it busy-spins a core); transfers progress when the
sender polls (`wait`) and the receiver polls (`poll_completed`). With UCX's shared-memory and
RDMA transports writes need no receiver progress; over TCP the receiver must keep polling.
Environment (not set here): UCX_NET_DEVICES, UCX_TLS select the UCX transports.

Threads: one NIXL agent (one UCX worker) must never be entered by two threads at once (a prefill
worker waits on each push from its own thread; concurrent posts and polls crashed in
`uct_cma_ep_tx`). Every agent call goes through the side's lock, and a transfer handle is
released exactly once, under that lock, after it finished or was cancelled; `close` aborts the
transfers still in flight before it releases descriptor lists and registrations.
"""

from __future__ import annotations

import threading
import uuid

import numpy as np

from flashpd.engine.transfer.base import (
    KVPools,
    KVReceiver,
    KVSender,
    TransferError,
    pool_regions,
)
from flashpd.engine.transfer.contract import TransferContract
from flashpd.engine.transfer.wire import PeerDescriptor, PoolRegion

_BACKEND = "UCX"


def _make_agent(name: str, progress_thread: bool):
    # Imported here: `nixl` loads native plugins, which tests of other backends never need.
    from nixl._api import nixl_agent, nixl_agent_config

    config = nixl_agent_config(enable_prog_thread=progress_thread, enable_listen_thread=False,
                               backends=[_BACKEND])
    agent = nixl_agent(name, config)
    if _BACKEND not in agent.backends:
        raise TransferError(f"NIXL plugin {_BACKEND} unavailable (have {agent.get_plugin_list()})")
    return agent


def _block_rows(regions: tuple[PoolRegion, ...]) -> np.ndarray:
    """[groups * num_blocks, 3] uint64 rows (address, length, device id), group-major."""
    rows = []
    for r in regions:
        block = np.arange(r.num_blocks, dtype=np.uint64)
        addresses = np.uint64(r.address) + block * np.uint64(r.block_bytes)
        rows.append(np.stack([addresses, np.full_like(block, r.block_bytes),
                              np.full_like(block, r.device_id)], axis=1))
    return np.concatenate(rows)


def _row_indices(num_groups: int, num_blocks: int, block_ids: np.ndarray) -> np.ndarray:
    """Rows of `block_ids` in every group, group-major: [num_groups * n] int32."""
    offsets = np.arange(num_groups, dtype=np.int64)[:, None] * num_blocks  # [G, 1]
    rows = (offsets + block_ids[None, :]).reshape(-1)  # [G * n]
    if rows.max() > np.iinfo(np.int32).max:
        raise TransferError("descriptor list too long for NIXL's int32 indices")
    return rows.astype(np.int32)


class NixlReceiver(KVReceiver):
    backend = "nixl"

    def __init__(self, contract: TransferContract, pools: KVPools, incarnation: str,
                 agent_name: str | None = None, progress_thread: bool = False):
        super().__init__(contract, pools, incarnation,
                         agent_name or f"flashpd-recv-{uuid.uuid4().hex[:12]}")
        self._lock = threading.Lock()
        self._agent = _make_agent(self.agent_name, progress_thread)
        tensors = [self.pools[name] for name in contract.group_names]
        self._registration = self._agent.register_memory(tensors, backends=[_BACKEND])
        self._metadata = self._agent.get_agent_metadata()  # fixed once memory is registered

    def _agent_metadata(self) -> bytes:
        return self._metadata

    def _fetch_notices(self) -> list[bytes]:
        with self._lock:
            if self._registration is None:
                return []
            by_sender = self._agent.get_new_notifs()  # sender agent name -> [message]
        return [msg for messages in by_sender.values() for msg in messages]

    def close(self) -> None:
        with self._lock:
            if self._registration is not None:
                self._agent.deregister_memory(self._registration, backends=[_BACKEND])
                self._registration = None


class NixlSender(KVSender):
    backend = "nixl"

    def __init__(self, contract: TransferContract, pools: KVPools,
                 agent_name: str | None = None, progress_thread: bool = False):
        super().__init__(contract, pools)
        self.agent_name = agent_name or f"flashpd-send-{uuid.uuid4().hex[:12]}"
        self._lock = threading.RLock()
        self._in_flight: set = set()  # posted xfers not yet released
        self._agent = _make_agent(self.agent_name, progress_thread)
        tensors = [self.pools[name] for name in contract.group_names]
        self._registration = self._agent.register_memory(tensors, backends=[_BACKEND])
        regions = pool_regions(contract, self.pools)
        self._local_rows = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _block_rows(regions), regions[0].mem_type, backends=[_BACKEND])
        self._remote_rows: dict[str, object] = {}  # peer -> prepared remote dlist

    def _attach(self, peer: PeerDescriptor) -> None:
        with self._lock:
            self._attach_locked(peer)

    def _attach_locked(self, peer: PeerDescriptor) -> None:
        try:
            loaded = self._agent.add_remote_agent(peer.agent_metadata)
        except Exception as e:  # nixlBind raises its own exception types
            raise TransferError(f"cannot load NIXL metadata of {peer.agent_name}: {e}") from e
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded_name != peer.agent_name:
            self._agent.remove_remote_agent(loaded_name)
            raise TransferError(f"descriptor names {peer.agent_name}, metadata {loaded_name}")
        # Remote rows in this side's group order, so one index array serves both lists.
        regions = tuple(peer.region(name) for name in self.contract.group_names)
        self._remote_rows[peer.agent_name] = self._agent.prep_xfer_dlist(
            peer.agent_name, _block_rows(regions), regions[0].mem_type, backends=[_BACKEND])

    def _detach(self, peer: PeerDescriptor) -> None:
        with self._lock:
            self._remote_rows.pop(peer.agent_name).release()
            self._agent.remove_remote_agent(peer.agent_name)

    def _post(self, peer: PeerDescriptor, src: np.ndarray, dst: np.ndarray, notice: bytes):
        num_groups = len(self.contract.groups)
        local = _row_indices(num_groups, self.num_blocks, src)
        remote = _row_indices(num_groups, peer.num_blocks, dst)
        with self._lock:
            if self._registration is None:
                raise TransferError("NIXL sender is closed")
            try:
                xfer = self._agent.make_prepped_xfer(
                    "WRITE", self._local_rows, local, self._remote_rows[peer.agent_name], remote,
                    notif_msg=notice, backends=[_BACKEND])
            except Exception as e:  # nixlBind raises its own exception types
                raise TransferError(f"NIXL post to {peer.agent_name} failed: {e}") from e
            try:
                state = self._agent.transfer(xfer)
            except Exception as e:  # nixlBind raises its own exception types
                xfer.release()
                raise TransferError(f"NIXL post to {peer.agent_name} failed: {e}") from e
            if state == "ERR":
                xfer.release()
                raise TransferError(f"NIXL post to {peer.agent_name} returned ERR")
            self._in_flight.add(xfer)
            return xfer

    def _poll(self, xfer) -> str:
        with self._lock:
            if xfer not in self._in_flight:
                return "ERR"  # released by close()
            state = self._agent.check_xfer_state(xfer)
            if state != "PROC":
                self._in_flight.discard(xfer)
                xfer.release()
            return state

    def _abort(self, xfer) -> None:
        with self._lock:
            if xfer not in self._in_flight:
                return
            self._in_flight.discard(xfer)
            try:
                xfer.release()  # NIXL cancels an active transfer on release
            except Exception as e:  # nixlBind raises its own exception types
                raise TransferError(f"NIXL could not cancel the transfer: {e}") from e

    def _notify(self, peer: PeerDescriptor, notice: bytes) -> None:
        with self._lock:
            try:
                self._agent.send_notif(peer.agent_name, notice)
            except Exception as e:  # nixlBind raises its own exception types
                raise TransferError(f"NIXL notice to {peer.agent_name} failed: {e}") from e

    def close(self) -> None:
        with self._lock:
            for xfer in list(self._in_flight):
                self._abort(xfer)
            for peer in list(self._peers):
                self.disconnect(peer)
            if self._registration is not None:
                self._local_rows.release()
                self._agent.deregister_memory(self._registration, backends=[_BACKEND])
                self._registration = None
