"""spawn(): local ranks over gloo on 127.0.0.1, results by rank, failures surfaced; groups."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from flashpd.engine.parallel.launch import Comm, SpawnError, init_groups, loopback_ifname, spawn
from flashpd.engine.parallel.plan import ParallelPlan


def _listening_ports() -> dict[int, str]:
    """Listening TCP port -> local address (hex, as /proc/net/tcp{,6} shows it)."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                address, port = fields[1].split(":")
                out[int(port, 16)] = address
    return out


def _sum_of_ranks(rank: int, world_size: int) -> tuple[float, str, str]:
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)
    return float(x), os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]


def test_spawn_returns_results_in_rank_order():
    results = spawn(2, _sum_of_ranks)
    assert [r[0] for r in results] == [1.0, 1.0]
    assert {r[1] for r in results} == {"127.0.0.1"}


def _store_listener(rank: int, world_size: int) -> str:
    return _listening_ports()[int(os.environ["MASTER_PORT"])]


def test_rendezvous_listens_on_loopback_only():
    (address,) = set(spawn(2, _store_listener))
    assert address == "0100007F"  # 127.0.0.1, not 0.0.0.0 or ::


def test_loopback_interface_is_found():
    assert loopback_ifname() == "lo"


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank one")
    return rank


def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(SpawnError, match="(?s)rank 1 raised.*boom on rank one"):
        spawn(2, _fail_on_rank_one, timeout_s=60)


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="unknown backend"):
        spawn(2, _sum_of_ranks, backend="mpi")


def _group_sums(rank: int, world_size: int, plan: ParallelPlan) -> tuple[float, float, int, int]:
    groups = init_groups(plan)
    tp = groups.tp.all_reduce_sum(torch.tensor([float(rank)]))
    ep = groups.ep.all_reduce_sum(torch.tensor([float(rank)]))
    return float(tp), float(ep), groups.tp.rank, groups.ep.size


def test_tp_groups_reduce_within_their_replica():
    results = spawn(4, _group_sums, ParallelPlan.from_name("tp2dp2"))
    assert results == [(1.0, 0.0, 0, 1), (1.0, 1.0, 1, 1), (5.0, 2.0, 0, 1), (5.0, 3.0, 1, 1)]


def test_ep_group_spans_every_rank():
    results = spawn(2, _group_sums, ParallelPlan.from_name("dp2ep2"))
    assert results == [(0.0, 1.0, 0, 2), (1.0, 1.0, 0, 2)]


def test_single_comm_needs_no_process_group():
    comm = Comm.single()
    x = torch.arange(3.0)
    assert comm.all_reduce_sum(x) is x
    assert comm.all_gather_cat(x, 0) is x
    assert comm.exchange_counts([3], x.device) == [3]
