"""Transport read-back: UCX's protocol tables parsed and judged (fake logs at the seam), the
run-merged descriptors, and the real NIXL over loopback in a fresh process (UCX reads its log
options when it loads, so each case gets its own interpreter)."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from flashpd.engine.transfer.base import _checked_runs_numpy, checked_runs
from flashpd.engine.transfer.nixl_backend import PoolTable, run_rows
from flashpd.engine.transfer.ucx_transport import (
    TransportFallback,
    enable_proto_log,
    judge,
    parse_put_tables,
    required_transports,
)
from flashpd.engine.transfer.wire import PoolRegion


def _table(title: str, rows: list[tuple[str, str, str]]) -> str:
    p = "[1796241349.5] [h200:4242:0]   "
    lines = [
        p + "+--------+",
        p + "| flashpd intra-node cfg#3 |",
        p + f"| {title} |",
        p + "+--------+",
        p + "| Range | Description | Config |",
        p + "+--------+",
    ]
    lines += [p + f"| {r} | {d} | {c} |" for r, d, c in rows]
    return "\n".join(lines + [p + "+--------+"])


GPU_IPC = _table(
    "remote memory write by ucp_put* from cuda/GPU0 to cuda/GPU0", [("0..inf", "zero-copy", "cuda_ipc/cuda")]
)
GPU_TCP = _table(
    "remote memory write by ucp_put* from cuda/GPU0 to cuda/GPU0",
    [("0..8K", "short", "tcp/lo"), ("8K..inf", "zero-copy", "tcp/lo")],
)
GPU_STAGED = _table(
    "remote memory write by ucp_put* from cuda/GPU0 to cuda/GPU0",
    [("0..inf", "pipeline cuda_copy", "cuda_copy/cuda + tcp/eth0")],
)
HOST_AM = _table("active message by ucp_am_send* from host memory", [("0..8184", "short", "tcp/lo")])
HOST_CMA = _table("remote memory write by ucp_put* from host memory to host", [("0..inf", "zero-copy", "cma/memory")])


def test_cuda_ipc_zero_copy_is_accepted_and_named():
    tables = parse_put_tables(HOST_AM + "\n" + GPU_IPC)
    assert judge(tables, "VRAM", 4352).transport == "cuda_ipc"


def test_tcp_for_vram_fails_loudly():
    with pytest.raises(TransportFallback, match="tcp/lo"):
        judge(parse_put_tables(GPU_TCP), "VRAM", 4352)


def test_host_staging_for_vram_fails_loudly():
    with pytest.raises(TransportFallback, match="cuda_copy"):
        judge(parse_put_tables(GPU_STAGED), "VRAM", 4352)


def test_no_gpu_table_cannot_confirm_zero_copy():
    with pytest.raises(TransportFallback, match="no GPU put protocol"):
        judge(parse_put_tables(HOST_AM + "\n" + HOST_CMA), "VRAM", 4352)


def test_ranges_below_the_smallest_descriptor_do_not_count():
    mixed = _table(
        "remote memory write by ucp_put* from cuda/GPU0 to cuda/GPU0",
        [("0..1K", "short copy-in", "cuda_copy/cuda"), ("1025..inf", "zero-copy", "cuda_ipc/cuda")],
    )
    assert judge(parse_put_tables(mixed), "VRAM", 4352).transport == "cuda_ipc"
    with pytest.raises(TransportFallback):
        judge(parse_put_tables(mixed), "VRAM", 512)


def test_dram_takes_what_ucx_picked_unless_transports_are_required():
    tables = parse_put_tables(HOST_CMA)
    assert judge(tables, "DRAM", 64).transport == "cma"
    assert judge(tables, "DRAM", 64, ("cma",)).transport == "cma"
    with pytest.raises(TransportFallback, match="required: tcp"):
        judge(tables, "DRAM", 64, ("tcp",))


def test_required_transports_parse_strictly():
    assert required_transports({"FLASHPD_KV_TRANSPORTS": "cuda_ipc, rc_mlx5"}) == ("cuda_ipc", "rc_mlx5")
    assert required_transports({}) == ()
    with pytest.raises(ValueError, match="FLASHPD_KV_TRANSPORTS"):
        required_transports({"FLASHPD_KV_TRANSPORTS": "cuda ipc"})


def test_proto_log_keeps_a_log_file_already_set():
    env = {"UCX_LOG_FILE": "/var/log/ucx.%p"}
    assert enable_proto_log(7, env) == "/var/log/ucx.7"
    assert env["UCX_PROTO_INFO"] == "y"


def test_block_runs_merge_ascending_pairs_whatever_their_order():
    runs = checked_runs([7, 5, 6, 9, 10, 2], [3, 1, 2, 8, 9, 20], 16, 32)
    assert (runs.src_start, runs.dst_start, runs.length, runs.num_blocks) == ((2, 5, 9), (20, 1, 8), (1, 3, 2), 6)
    assert runs.src.tolist() == [2, 5, 6, 7, 9, 10] and runs.dst.tolist() == [20, 1, 2, 3, 8, 9]


def test_block_runs_split_where_only_one_side_is_contiguous():
    assert checked_runs([0, 1, 2, 3], [0, 1, 5, 6], 8, 8).length == (2, 2)


def test_a_prompt_allocated_in_order_is_one_run():
    runs = checked_runs(list(range(40, 1064)), tuple(range(9, 1033)), 2048, 2048)
    assert (runs.src_start, runs.dst_start, runs.length, runs.num_blocks) == ((40,), (9,), (1024,), 1024)


@pytest.mark.parametrize(
    "src, dst",
    [
        (list(range(3, 7)), list(range(10, 14))),  # the list fast path
        (tuple(range(3, 7)), tuple(range(10, 14))),  # tuples (a ticket's dst ids)
        (range(3, 7), range(10, 14)),
        (np.arange(3, 7), np.arange(10, 14)),  # arrays: the numpy path
        ([np.int64(b) for b in range(3, 7)], list(range(10, 14))),  # numpy ints: the numpy path
        ([3, 4, 5, 6], [10, 11, 12, 14]),  # one side not a run: the numpy path
        ([6, 5, 4, 3], [13, 12, 11, 10]),  # descending pairs: sorted into one run
    ],
)
def test_every_input_kind_gives_the_numpy_paths_runs(src, dst):
    runs = checked_runs(src, dst, 16, 16)
    assert runs == _checked_runs_numpy(src, dst, 16, 16)
    assert all(type(v) is int for v in runs.src_start + runs.dst_start + runs.length)


def test_random_pairs_give_the_numpy_paths_runs():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        src = (int(rng.integers(0, 20)) + np.arange(n)).tolist()
        dst = (int(rng.integers(0, 20)) + np.arange(n)).tolist()
        if rng.random() < 0.5:  # break a run somewhere
            dst[int(rng.integers(0, n))] += 60
        runs = checked_runs(src, dst, 64, 128)
        assert runs == _checked_runs_numpy(src, dst, 64, 128)
        assert runs.src.tolist() == src and runs.dst.tolist() == dst


@pytest.mark.parametrize(
    "src, dst, message",
    [
        ([6, 7, 8], [0, 1, 2], r"src_block_ids outside \[0, 8\)"),  # a run past the end
        ([-1, 0], [0, 1], r"src_block_ids outside \[0, 8\)"),
        ([0, 1], [7, 8], r"dst_block_ids outside the peer's \[0, 8\)"),
        ((0, 1), (-2, -1), r"dst_block_ids outside the peer's \[0, 8\)"),
        ([0, 1, 2], [0, 1], "need equal, non-empty block lists, got 3 -> 2"),
        ([], [], "need equal, non-empty block lists, got 0 -> 0"),
        ([0, 1], [3, 3], "duplicate dst_block_ids"),
    ],
)
def test_runs_that_fail_a_check_raise_the_numpy_paths_error(src, dst, message):
    with pytest.raises(ValueError, match=message):
        checked_runs(src, dst, 8, 8)


def test_run_rows_one_descriptor_per_group_and_run():
    regions = (PoolRegion("main.L2", 1000, 16, 256, 0, "VRAM"), PoolRegion("index.L2", 9000, 16, 64, 0, "VRAM"))
    rows = run_rows(PoolTable.of(regions), (2, 5), (3, 1))
    assert rows == [(1512, 768, 0), (2280, 256, 0), (9128, 192, 0), (9320, 64, 0)]


_SCRIPT = textwrap.dedent("""
    import json, threading, time, torch
    from flashpd.engine.transfer import GroupSpec, TransferContract
    from flashpd.engine.transfer.nixl_backend import NixlReceiver, NixlSender
    from flashpd.engine.transfer.ucx_transport import TransportFallback
    contract = TransferContract("t", (GroupSpec("main.L2", 4096, "f"),
                                      GroupSpec("index.L2", 1024, "g")))
    def pools(fill):
        return {g.name: torch.full((8, g.block_bytes), fill, dtype=torch.uint8)
                for g in contract.groups}
    rx = NixlReceiver(contract, pools(0), "inc")
    tx = NixlSender(contract, pools(7))
    peer = tx.connect(rx.descriptor())
    rx.expect("r0", [3, 4, 5], 1e12, "inc")
    rx.expect("r1", [3, 4, 5], 1e12, "inc1")
    stop = threading.Event()
    def progress():  # the receiver's side of UCX progresses only when it is polled
        while not stop.is_set():
            rx.poll_completed()
            time.sleep(1e-4)
    poller = threading.Thread(target=progress)
    poller.start()
    out = {}
    for attempt in range(2):
        try:
            h = tx.send(f"r{attempt}", [0, 1, 2], [3, 4, 5], "inc" if attempt == 0 else "inc1")
            tx.wait(h, 30.0)
            out[attempt] = ["ok", tx.transports[peer].transport, tx.last_num_descriptors]
        except TransportFallback as e:
            out[attempt] = ["fallback", str(e)[:200]]
    stop.set()
    poller.join()
    out["bytes_equal"] = bool((rx.pools["main.L2"][3:6] == 7).all())
    tx.close(); rx.close()
    print("RESULT " + json.dumps(out))
""")


def _run(extra_env: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_LOG")}
    env.update(UCX_NET_DEVICES="lo", NIXL_LOG_LEVEL="WARN", **extra_env)
    done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(line[0][7:])


@pytest.mark.net
def test_real_nixl_reads_back_the_transport_it_used(tmp_path):
    pytest.importorskip("nixl")
    out = _run({"UCX_LOG_FILE": str(tmp_path / "ucx.%p")})
    assert out["0"][0] == "ok" and out["0"][1] in ("cma", "tcp", "posix", "sysv")
    assert out["0"][2] == 2  # two groups, one run each
    assert out["bytes_equal"]


@pytest.mark.net
def test_real_nixl_over_tcp_fails_when_another_transport_is_required(tmp_path):
    pytest.importorskip("nixl")
    out = _run({"UCX_LOG_FILE": str(tmp_path / "ucx.%p"), "UCX_TLS": "tcp,self", "FLASHPD_KV_TRANSPORTS": "cma"})
    assert out["0"][0] == "fallback" and "tcp" in out["0"][1]
    assert out["1"][0] == "fallback"  # the peer stays barred: no silent second try


def test_puts_from_host_memory_do_not_count_for_vram_pools():
    """What the H200 stack's log held: a host->GPU put table over TCP emulation beside the
    GPU->GPU one over cuda_ipc; the KV's descriptors are GPU memory on both sides."""
    host_to_gpu = _table(
        "remote memory write by ucp_put* from host memory to cuda/dev[1]", [("0..inf", "software emulation", "tcp/lo")]
    )
    gpu_to_gpu = _table(
        "remote memory write by ucp_put* from cuda/GPU0 to cuda/dev[1]", [("0..inf", "zero-copy", "cuda_ipc/cuda")]
    )
    tables = parse_put_tables(host_to_gpu + "\n" + gpu_to_gpu)
    assert judge(tables, "VRAM", 4352, ("cuda_ipc",)).transport == "cuda_ipc"
