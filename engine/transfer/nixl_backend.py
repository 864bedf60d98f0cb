"""NIXL transfer backend (UCX): one-sided WRITEs of pool blocks plus a completion notification.

Each side runs one NIXL agent and registers its pools (DRAM on CPU hosts, VRAM on GPU hosts).
The receiver's descriptor carries its agent metadata and pool addresses; the sender loads
the metadata at connect and, per push, builds one descriptor row per (group, run) on each side:

    row(group g, run (start, length)) -> (pool_g address + start * block_bytes_g, length * block_bytes_g)

A send groups its (src, dst) block pairs into runs that ascend by one on both sides and posts
one descriptor per (group, run): a prompt whose blocks were allocated in order moves in one
operation per group, whatever order the pairs came in (one operation per 113,920-byte block
went at 15-22 GB/s between two H200 processes, merged runs at 285-1,266 GB/s). The rows are
plain tuples (8 for a one-run push) for `initialize_xfer`. NIXL's prepared lists were measured
as the alternative (`prep_xfer_dlist` once per side, one strided entry per group, then
`make_prepped_xfer` with per-block indices, which NIXL 1.5 merges back into one descriptor per
(group, run): telemetry descCount 8 for a 256-block run): cheaper for a 1-block push, dearer
from 8K tokens on (the [groups, blocks] index arrays), so not used
(bench/results/transfer_phases_cpu.md). The notice bytes ride as the transfer's notification,
which NIXL delivers to the receiver after the data.

Transport check: every agent's process logs UCX's protocol choices (`ucx_transport`); after
the first completed WRITE to a peer the sender reads back which transport moved the bytes,
logs it, and refuses that peer from then on if it was a fallback (TCP or host staging for
VRAM pools, or anything outside FLASHPD_KV_TRANSPORTS): the transfer raises
TransportFallback instead of serving at a fraction of the speed.

Progress: by default no NIXL progress thread (it busy-spins a core); transfers progress when the
sender polls (`wait`) and the receiver polls (`poll_completed`). With UCX's shared-memory and
RDMA transports writes need no receiver progress; over TCP the receiver must keep polling.
Environment (not set here): UCX_NET_DEVICES, UCX_TLS select the UCX transports.

CUDA context: UCX's cuda_ipc posts its copies with the CUDA driver on the calling thread. A
thread that never touched CUDA (the Serve replica's event loop, a push thread) has no current
context, so VRAM senders make their device current on each thread before its first agent call
(`bind_cuda_context`, on by default; `bench/transfer_phases.py --bind-cuda-context off` measures
the difference).

Threads: one NIXL agent (one UCX worker) must never be entered by two threads at once (a prefill
worker waits on each push from its own thread; concurrent posts and polls crashed in
`uct_cma_ep_tx`). Every agent call goes through the side's lock, and a transfer handle is
released exactly once, under that lock, after it finished or was cancelled; `close` aborts the
transfers still in flight before it releases descriptor lists and registrations.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass

import torch

from flashpd.engine.transfer import ucx_transport
from flashpd.engine.transfer.base import BlockRuns, KVPools, KVReceiver, KVSender, TransferError, pool_regions
from flashpd.engine.transfer.contract import TransferContract
from flashpd.engine.transfer.wire import PeerDescriptor, PoolRegion

log = logging.getLogger(__name__)

_BACKEND = "UCX"


def _make_agent(name: str, progress_thread: bool):
    ucx_transport.enable_proto_log()  # before UCX loads in this process (no effect after)
    # Imported here: `nixl` loads native plugins, which tests of other backends never need.
    from nixl._api import nixl_agent, nixl_agent_config

    config = nixl_agent_config(enable_prog_thread=progress_thread, enable_listen_thread=False, backends=[_BACKEND])
    agent = nixl_agent(name, config)
    if _BACKEND not in agent.backends:
        raise TransferError(f"NIXL plugin {_BACKEND} unavailable (have {agent.get_plugin_list()})")
    return agent


@dataclass(frozen=True)
class PoolTable:
    """One side's pools in the contract's group order (built once per side and peer, not per
    push): group g's block b starts at rows[g].address + b * rows[g].block_bytes."""

    rows: tuple[tuple[int, int, int], ...]  # [G] (address, block_bytes, device id)
    mem_type: str  # "DRAM" | "VRAM"

    @classmethod
    def of(cls, regions: tuple[PoolRegion, ...]) -> PoolTable:
        mem_types = {r.mem_type for r in regions}
        if len(mem_types) != 1:
            raise TransferError(f"pools span memory types {sorted(mem_types)}")
        return cls(tuple((r.address, r.block_bytes, r.device_id) for r in regions), mem_types.pop())


def run_rows(table: PoolTable, starts: tuple[int, ...], lengths: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """[groups * R] descriptor rows (address, bytes, device id), group-major: one per (group,
    run). Plain tuples: 8 of them for a one-run push, where numpy's per-call cost on cold
    caches was most of the descriptors' time."""
    return [(a + s * bb, n * bb, dev) for a, bb, dev in table.rows for s, n in zip(starts, lengths, strict=True)]


HOT_POLL_S = 2e-4  # the receiver's progress interval while a KV write is expected
COLD_POLL_S = 0.02  # ... and while none is


class NixlReceiver(KVReceiver):
    """Receiver progress: a write completes at the sender only once the receiver's UCX worker
    has progressed (measured over UCX on one host: the sender's post -> done was 1.3 ms with
    the receiver polling every 100 us, 5.5 ms every 5 ms). The decode engine polls once per
    loop iteration (5 ms idle, a whole decode step when busy), which put a flat ~7 ms on every
    push on the H200 whatever its size. So a thread of the receiver's own progresses it every
    HOT_POLL_S while a request is expected (from `expect` until the ledger holds none) and every
    COLD_POLL_S otherwise, keeping the notices for `poll_completed` (progress_interval_s=0:
    no thread; progress only when the owner polls)."""

    backend = "nixl"

    def __init__(
        self,
        contract: TransferContract,
        pools: KVPools,
        incarnation: str,
        agent_name: str | None = None,
        progress_thread: bool = False,
        progress_interval_s: float = HOT_POLL_S,
    ):
        super().__init__(contract, pools, incarnation, agent_name or f"flashpd-recv-{uuid.uuid4().hex[:12]}")
        self._lock = threading.Lock()
        self._agent = _make_agent(self.agent_name, progress_thread)
        tensors = [self.pools[name] for name in contract.group_names]
        self._registration = self._agent.register_memory(tensors, backends=[_BACKEND])
        self._metadata = self._agent.get_agent_metadata()  # fixed once memory is registered
        self._inbox: list[bytes] = []  # notices the progress thread took, not yet fetched
        self._hot = threading.Event()  # a write is expected: progress every interval
        self._closed = threading.Event()
        self._progress: threading.Thread | None = None
        self.num_pumps = 0  # progress calls made by the thread (diagnostics, tests)
        if progress_interval_s > 0:
            self._progress = threading.Thread(
                target=self._progress_loop, args=(progress_interval_s,), name=f"{self.agent_name}-progress", daemon=True
            )
            self._progress.start()

    def _agent_metadata(self) -> bytes:
        return self._metadata

    def expect(
        self, request_id: str, dst_block_ids, lease_deadline_s: float, incarnation: str, issued_s: float | None = None
    ) -> None:
        super().expect(request_id, dst_block_ids, lease_deadline_s, incarnation, issued_s)
        self._hot.set()

    def poll_completed(self) -> list[str]:
        done = super().poll_completed()
        if not self.live_request_ids:  # nothing expected: back to the cold interval (an
            self._hot.clear()  # `expect` racing this sets it again at its next request)
        return done

    def _progress_loop(self, interval_s: float) -> None:
        while not self._closed.is_set():
            if self._hot.is_set():
                self._closed.wait(interval_s)
            else:
                self._hot.wait(COLD_POLL_S)
            with self._lock:
                if self._registration is None:
                    return
                notices = self._take_notifs_locked()
                self._inbox.extend(notices)
                self.num_pumps += 1
            if notices and self.on_notice is not None:
                self.on_notice()

    def _take_notifs_locked(self) -> list[bytes]:
        by_sender = self._agent.get_new_notifs()  # sender agent name -> [message]
        return [msg for messages in by_sender.values() for msg in messages]

    def _fetch_notices(self) -> list[bytes]:
        with self._lock:
            if self._registration is None:
                return []
            notices, self._inbox = self._inbox, []
            notices.extend(self._take_notifs_locked())
        return notices

    def close(self) -> None:
        self._closed.set()
        self._hot.set()  # wake a cold wait
        if self._progress is not None and self._progress is not threading.current_thread():
            self._progress.join(timeout=5.0)
        with self._lock:
            if self._registration is not None:
                self._agent.deregister_memory(self._registration, backends=[_BACKEND])
                self._registration = None


class NixlSender(KVSender):
    backend = "nixl"

    def __init__(
        self,
        contract: TransferContract,
        pools: KVPools,
        agent_name: str | None = None,
        progress_thread: bool = False,
        required_transports: tuple[str, ...] | None = None,
        bind_cuda_context: bool = True,
    ):
        super().__init__(contract, pools)
        self.agent_name = agent_name or f"flashpd-send-{uuid.uuid4().hex[:12]}"
        self._lock = threading.RLock()
        self._in_flight: set = set()  # posted xfers not yet released
        self._prepared: set = set()  # initialised xfers not posted yet (prepare -> post)
        self._proto_log = ucx_transport.enable_proto_log()
        self._required = (
            ucx_transport.required_transports() if required_transports is None else tuple(required_transports)
        )
        self._agent = _make_agent(self.agent_name, progress_thread)
        tensors = [self.pools[name] for name in contract.group_names]
        self._registration = self._agent.register_memory(tensors, backends=[_BACKEND])
        self._local = PoolTable.of(pool_regions(contract, self.pools))
        self._remote: dict[str, PoolTable] = {}  # peer -> its pools (made at connect)
        self._mem_type = self._local.mem_type
        first = next(iter(self.pools.values()))
        self._cuda_device = first.device.index if (bind_cuda_context and first.is_cuda) else None
        self._bound = threading.local()  # .done: this thread has the pools' device current
        self._min_desc_bytes = min(bb for _, bb, _ in self._local.rows)
        # peer -> the transport UCX used for it (checked once), or the fallback that bars it
        self.transports: dict[str, ucx_transport.TransportReport] = {}
        self._barred: dict[str, ucx_transport.TransportFallback] = {}
        self.last_num_descriptors = 0  # descriptors of the last send (one per group and run)

    def _bind_cuda(self) -> None:
        """Make the pools' device (its primary context) current on the calling thread, once per
        thread: what UCX's cuda_ipc copies run in."""
        if self._cuda_device is None or getattr(self._bound, "done", False):
            return
        torch.cuda.set_device(self._cuda_device)
        self._bound.done = True

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
        self._remote[peer.agent_name] = PoolTable.of(tuple(peer.region(g) for g in self.contract.group_names))

    def _detach(self, peer: PeerDescriptor) -> None:
        with self._lock:
            self._remote.pop(peer.agent_name, None)
            self._agent.remove_remote_agent(peer.agent_name)

    def _descriptors(self, peer: PeerDescriptor, runs: BlockRuns):
        """Local and remote descriptor lists, one row per (group, run), in the same order."""
        remote = self._remote[peer.agent_name]
        local_rows = run_rows(self._local, runs.src_start, runs.length)
        remote_rows = run_rows(remote, runs.dst_start, runs.length)
        return (
            self._agent.get_xfer_descs(local_rows, self._mem_type),
            self._agent.get_xfer_descs(remote_rows, remote.mem_type),
            len(local_rows),
        )

    def _post(self, peer: PeerDescriptor, runs: BlockRuns, notice: bytes, trace: dict[str, float]):
        return self._post_prepared(self._prepare(peer, runs, notice, trace), trace)

    def _prepare(self, peer: PeerDescriptor, runs: BlockRuns, notice: bytes, trace: dict[str, float]):
        """The descriptor lists and NIXL's transfer request (initialised, not posted)."""
        t0 = time.perf_counter()
        with self._lock:
            if self._registration is None:
                raise TransferError("NIXL sender is closed")
            if peer.agent_name in self._barred:
                raise self._barred[peer.agent_name]
            self._bind_cuda()
            t1 = time.perf_counter()
            local, remote, self.last_num_descriptors = self._descriptors(peer, runs)
            t2 = time.perf_counter()
            try:
                xfer = self._agent.initialize_xfer("WRITE", local, remote, peer.agent_name, notice, backends=[_BACKEND])
            except Exception as e:  # nixlBind raises its own exception types
                raise TransferError(f"NIXL post to {peer.agent_name} failed: {e}") from e
            self._prepared.add(xfer)
        t3 = time.perf_counter()
        trace.update(
            lock_ms=1e3 * (t1 - t0),
            descriptors_ms=1e3 * (t2 - t1),
            nixl_init_ms=1e3 * (t3 - t2),
            num_descriptors=self.last_num_descriptors,
        )
        return (peer.agent_name, xfer)

    def _post_prepared(self, state, trace: dict[str, float]):
        peer_name, xfer = state
        t3 = time.perf_counter()
        with self._lock:
            if xfer not in self._prepared:  # released by close()
                raise TransferError("NIXL sender is closed")
            self._prepared.discard(xfer)
            if self._registration is None:
                xfer.release()
                raise TransferError("NIXL sender is closed")
            if peer_name in self._barred:
                xfer.release()
                raise self._barred[peer_name]
            self._bind_cuda()
            try:
                state = self._agent.transfer(xfer)
            except Exception as e:  # nixlBind raises its own exception types
                xfer.release()
                raise TransferError(f"NIXL post to {peer_name} failed: {e}") from e
            if state == "ERR":
                xfer.release()
                raise TransferError(f"NIXL post to {peer_name} returned ERR")
            self._in_flight.add(xfer)
        trace["nixl_post_ms"] = 1e3 * (time.perf_counter() - t3)
        return xfer

    def _discard_prepared(self, state) -> None:
        _, xfer = state
        with self._lock:
            if xfer in self._prepared:
                self._prepared.discard(xfer)
                xfer.release()

    def _check_done(self, handle) -> None:
        """The first completed WRITE to a peer: read back UCX's transport and judge it."""
        if handle.peer in self.transports:
            return
        if handle.peer in self._barred:
            raise self._barred[handle.peer]
        tables = ucx_transport.parse_put_tables(ucx_transport.read_log(self._proto_log))
        try:
            report = ucx_transport.judge(tables, self._mem_type, self._min_desc_bytes, self._required)
        except ucx_transport.TransportFallback as e:
            self._barred[handle.peer] = e
            log.error("KV transport to %s REFUSED: %s", handle.peer, e)
            raise
        self.transports[handle.peer] = report
        log.warning(
            "KV transport to %s: %s (%s pools; %s)", handle.peer, report.transport, self._mem_type, report.summary()
        )

    def _poll(self, xfer) -> str:
        with self._lock:
            if xfer not in self._in_flight:
                return "ERR"  # released by close()
            self._bind_cuda()
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
            self._bind_cuda()
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
            for xfer in list(self._prepared):
                self._prepared.discard(xfer)
                xfer.release()
            for peer in list(self._peers):
                self.disconnect(peer)
            if self._registration is not None:
                self._agent.deregister_memory(self._registration, backends=[_BACKEND])
                self._registration = None
