"""Process groups: start ranks on one host (`spawn`), build the TP and EP groups of a plan.

Everything listens on 127.0.0.1 only. The rendezvous TCPStore is served by the parent on a socket
it bound to 127.0.0.1:0 (a TCPStore given only a port listens on every interface); gloo binds the
loopback interface (GLOO_SOCKET_IFNAME), NCCL bootstraps over it (NCCL_SOCKET_IFNAME) and runs with
NVLink multicast off (NCCL_NVLS_ENABLE=0).

Ranks are forked for gloo (CPU: a fork costs ~0.1 s where a fresh interpreter re-imports torch in
~10 s on a busy 2-core box) and spawned for NCCL (CUDA cannot survive a fork).
"""

from __future__ import annotations

import datetime
import fcntl
import os
import pickle
import queue
import socket
import struct
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashpd.engine.parallel.plan import ParallelPlan

LOOPBACK = "127.0.0.1"
BACKENDS = ("gloo", "nccl")
_SIOCGIFADDR = 0x8915


class SpawnError(RuntimeError):
    """A rank raised, died or timed out (message carries the rank's traceback)."""


# ============================================================================ groups
@dataclass(frozen=True)
class Comm:
    """One process group as the parallel blocks see it; size 1 needs no torch.distributed."""

    group: dist.ProcessGroup | None
    size: int
    rank: int

    @classmethod
    def single(cls) -> Comm:
        return cls(None, 1, 0)

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the group (in place on x when size > 1)."""
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather_cat(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's x, concatenated along `dim` in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def all_to_all(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """rows [sum(send_counts), ...]: block r goes to rank r; returns [sum(recv_counts), ...]."""
        if self.size == 1:
            return rows
        out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv_counts, send_counts, group=self.group)
        return out

    def exchange_counts(self, send_counts: list[int], device: torch.device) -> list[int]:
        """Counts rank r sends to me, for each r (the transpose of everyone's send_counts).

        `device`: where the collective runs (NCCL needs CUDA tensors, gloo takes CPU ones)."""
        if self.size == 1:
            return list(send_counts)
        send = torch.tensor(send_counts, dtype=torch.int64, device=device)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.tolist()


@dataclass(frozen=True)
class ParallelGroups:
    tp: Comm
    ep: Comm

    @classmethod
    def single(cls) -> ParallelGroups:
        return cls(Comm.single(), Comm.single())


def init_groups(plan: ParallelPlan) -> ParallelGroups:
    """The TP group of this rank's replica and the EP group; every rank must call it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != plan.world_size:
        raise ValueError(f"plan {plan.name} needs {plan.world_size} ranks, the world has {world}")
    tp = Comm.single()
    if plan.tp_size > 1:
        for dp_rank in range(plan.dp_size):  # new_group is collective: same order everywhere
            ranks = plan.tp_group_ranks(dp_rank)
            group = dist.group.WORLD if plan.dp_size == 1 else dist.new_group(list(ranks))
            if rank in ranks:
                tp = Comm(group, plan.tp_size, plan.tp_rank(rank))
    ep = Comm(dist.group.WORLD, world, rank) if plan.ep_size > 1 else Comm.single()
    return ParallelGroups(tp, ep)


# ============================================================================ spawn
def free_loopback_socket() -> socket.socket:
    """A listening TCP socket bound to 127.0.0.1 on a free port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    sock.listen(128)
    return sock


def loopback_ifname() -> str:
    """Name of the interface holding 127.0.0.1 (gloo and NCCL bind by interface name)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:  # interface without an IPv4 address
                continue
            if socket.inet_ntoa(reply[20:24]) == LOOPBACK:
                return name
    finally:
        probe.close()
    raise OSError(f"no network interface holds {LOOPBACK}")


def rank_environment(rank: int, world_size: int, port: int, backend: str) -> dict[str, str]:
    env = {
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
    }
    if backend == "gloo":
        env["GLOO_SOCKET_IFNAME"] = loopback_ifname()
    else:
        env.update(NCCL_SOCKET_IFNAME=loopback_ifname(), NCCL_NVLS_ENABLE="0")
    return env


def _run_rank(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
) -> None:
    """Body of one rank: join the group, run fn, report (ok, pickled result) or the traceback."""
    try:
        os.environ.update(rank_environment(rank, world_size, port, backend))
        if backend == "gloo":
            torch.set_num_threads(1)  # an OpenMP pool inherited through fork is not usable
        else:
            torch.cuda.set_device(rank)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(LOOPBACK, port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, pickle.dumps(value)))  # plain pickle: tensors by value
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def spawn(
    world_size: int, fn: Callable[..., Any], *args: Any, backend: str = "gloo", timeout_s: float = 120.0
) -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` local ranks; returns results by rank.

    The process group is initialised before fn and destroyed after it. For "nccl", fn and args
    must be picklable (ranks are spawned) and rank r uses GPU r.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("fork" if backend == "gloo" else "spawn")
    listener = free_loopback_socket()
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        LOOPBACK,
        port,
        world_size,
        is_master=True,  # owns the socket now
        master_listen_fd=listener.detach(),
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_run_rank, daemon=True, args=(r, world_size, port, backend, timeout_s, fn, args, results))
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        return _collect(procs, results, timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(timeout=10)
        del store


def _collect(procs: list, results: Any, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    values: dict[int, Any] = {}
    while len(values) < len(procs):
        try:
            rank, ok, payload = results.get(timeout=0.1)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode not in (None, 0)]
            if dead:
                raise SpawnError(
                    f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a result"
                ) from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(procs))) - set(values))
                raise SpawnError(f"ranks {missing} gave no result within {timeout_s} s") from None
            continue
        if not ok:
            raise SpawnError(f"rank {rank} raised:\n{payload}")
        values[rank] = pickle.loads(payload)
    return [values[r] for r in range(len(procs))]
