"""Where a KV push's time goes, phase by phase: NIXL over UCX between two processes.

    python -m flashpd.bench.transfer_phases --reps 15 --out bench/results/transfer_phases_cpu.md

The sender is a NixlSender in this process, the receiver a NixlReceiver in a spawned process
whose owner loop mirrors the decode worker's engine loop: it sleeps up to --owner-wait-us
(5 ms: the engine loop's idle wait) unless the receiver's progress thread wakes it with a
notice (`on_notice`), then polls completions. Each push mirrors the prefill worker's
(services/prefill/server.py): from the asyncio loop at "compute end" through
`run_in_executor` onto a push thread, `send` + `wait` there, back onto the loop.

Per prompt size (the released config's 890 B/token KV, 113,920 B per 128-token block, 8
groups) the table gives the median over --reps pushes of:
  hop        loop -> the push thread starts (0 on the inline path: the loop posts)
  check, notice, lock, descriptors, nixl_init, nixl_post   `send`'s phases (TransferHandle.trace):
             block-id checks, the notice's bytes, the sender's lock, descriptor rows + NIXL
             descriptor lists, NIXL initialize_xfer, NIXL transfer (the post); descs: the
             descriptors posted (one per group and run: 8 for the released layout's one run,
             1 with `--layout block_major`, the same bytes as one group of 113,920-byte blocks)
  done       the post's return -> completion seen by the sender's poll (polls: how many)
  back       the push thread's return -> the loop resumes (inline: the last poll -> the loop)
  e2e        loop -> loop: what the prefill worker's `transfer_ms` measures (compute end ->
             push done); GB/s e2e = bytes / e2e
  transport  post (before descriptors) -> completion seen (TransferStats.seconds); GB/s
  notify     `send` -> the receiver's owner has the request complete (one monotonic clock)
The first push to the peer (UCX wire-up) is reported on its own (`first_push_ms`), never in
the medians. Bytes are verified after the last push of each size.

`--device cuda` puts both sides' pools in VRAM (UCX's cuda_ipc on one GPU); `--loop-thread
fresh` pushes from a thread that never touched CUDA (a Serve replica's event loop);
`--in-ray-actor` runs the sender in a Ray actor's process; `--ballast-gb`/`--ballast-graphs` make
the sender's process hold what a replica's does beside its pools (device memory in many
allocations, captured CUDA graphs), to find what slows NIXL's post there. UCX's own settings
(UCX_MEMTYPE_CACHE, UCX_CUDA_IPC_CACHE, ...) are environment variables of the run.
`--busy-threads N` runs N Python threads in the sender's process that take the GIL in bursts
(`--busy-burst-us` of Python, then `--busy-idle-us` blocked), as a replica's engine loop and
Ray's threads do beside the push; `--switch-interval-us` sets the interpreter's GIL switch
interval (sys.setswitchinterval, default 5,000 us) for the run.
On a CPU host the copy is a CPU
memcpy (cma, ~4 GB/s on a shared 2-core VM): the size-dependent part is the CPU's, the fixed
costs (everything but `done` at large sizes) are what carries over to the GPU, where cuda_ipc
moves 117 MB in well under a millisecond.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import queue
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from flashpd.bench.transfer_bench import LAYOUTS, digest, nixl_pair, reply
from flashpd.engine.transfer import TransferContract
from flashpd.engine.transfer.contract import CHUNK_TOKENS

SIZES_TOKENS = (128, 8192, 32768, 131072)
SEND_PHASES = (
    "check_ms",
    "notice_ms",
    "lock_ms",
    "descriptors_ms",
    "num_descriptors",
    "nixl_init_ms",
    "nixl_post_ms",
    "done_ms",
    "polls",
    "send_cpu_ms",
    "send_vcsw",
    "send_ivcsw",
    "done_cpu_ms",
    "done_vcsw",
    "done_ivcsw",
)
COUNTS = (
    "polls",
    "num_descriptors",
    "send_vcsw",
    "send_ivcsw",
    "done_vcsw",
    "done_ivcsw",
)  # columns that are counts, not ms


def receiver_main(conn, contract_json: str, num_blocks: int, owner_wait_s: float, device: str = "cpu") -> None:
    """Child process: a NixlReceiver whose owner loop wakes on notices or every owner_wait_s
    (as the decode engine loop does) and reports ("done", request_id, monotonic time)."""
    from flashpd.engine.transfer.nixl_backend import NixlReceiver

    contract = TransferContract.from_json(contract_json)
    pools = {g.name: torch.zeros(num_blocks, g.block_bytes, dtype=torch.uint8, device=device) for g in contract.groups}
    receiver = NixlReceiver(contract, pools, incarnation="bench-decode")
    wake, commands = threading.Event(), queue.SimpleQueue()
    receiver.on_notice = wake.set

    def read_pipe():
        while True:
            message = conn.recv()
            commands.put(message)
            wake.set()
            if message[0] == "stop":
                return

    threading.Thread(target=read_pipe, daemon=True).start()
    conn.send(receiver.descriptor())
    while True:
        wake.wait(owner_wait_s)
        wake.clear()
        for request_id in receiver.poll_completed():
            conn.send(("done", request_id, time.monotonic()))
        while not commands.empty():
            command, *args = commands.get()
            if command == "stop":
                receiver.close()
                return
            if command == "expect":
                receiver.expect(args[0], args[1], time.monotonic() + 600, "bench-prefill")
                conn.send(("ok",))
            elif command == "digest":
                conn.send(("digest", digest(receiver.pools, args[0])))


class Pusher:
    """The prefill worker's push path. "inline" (services/prefill/server.py since 3de969e):
    send + up to INLINE_WAIT_S of polls on the loop, a push thread waits only on a slower
    push; "thread" (before): loop -> push thread (send + wait) -> loop."""

    def __init__(self, sender, conn, path: str, before=None, prepare_ahead: bool = False):
        self.sender, self.conn, self.path = sender, conn, path
        self.before = before  # untimed work before each push (what a prefill does before kv_ready)
        self.prepare_ahead = prepare_ahead  # build the write before that work, post at "compute end"
        self._prepared = None
        self.threads = ThreadPoolExecutor(4, thread_name_prefix="bench-push")
        if path == "inline":  # imported here, not in the first timed push (~0.5 s of imports)
            from flashpd.services.prefill.server import INLINE_WAIT_S

            self.inline_wait_s = INLINE_WAIT_S

    def _push(self, request_id: str, src: list[int], dst: list[int], marks: dict) -> object:
        marks["thread_s"] = time.monotonic()
        handle = self.sender.send(request_id, src, dst, "bench-prefill")
        stats = self.sender.wait(handle, timeout_s=60)
        marks["thread_end_s"] = time.monotonic()
        return handle, stats

    def _push_inline(self, request_id: str, src: list[int], dst: list[int], marks: dict):
        marks["thread_s"] = time.monotonic()  # no hop: the loop itself
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            handle = self.sender.post(prepared)
        else:
            handle = self.sender.send(request_id, src, dst, "bench-prefill")
        stats = self.sender.poll_briefly(handle, self.inline_wait_s)
        marks["thread_end_s"] = time.monotonic()
        return handle, stats

    async def push(self, request_id: str, src: list[int], dst: list[int]) -> dict:
        self.conn.send(("expect", request_id, dst))
        reply(self.conn, "ok")
        marks: dict = {}
        loop = asyncio.get_running_loop()
        if self.prepare_ahead and self.path == "inline":
            self._prepared = self.sender.prepare(request_id, src, dst, "bench-prefill")
        if self.before is not None:
            self.before()
        t0 = time.monotonic()  # "compute end"
        if self.path == "inline":
            handle, stats = self._push_inline(request_id, src, dst, marks)
            if stats is None:
                stats = await loop.run_in_executor(self.threads, self.sender.wait, handle, 60.0)
                marks["thread_end_s"] = time.monotonic()
        else:
            handle, stats = await loop.run_in_executor(self.threads, self._push, request_id, src, dst, marks)
        t1 = time.monotonic()
        _, done_id, done_s = reply(self.conn, "done")
        assert done_id == request_id, (done_id, request_id)
        row = {k: float(v) for k, v in getattr(handle, "trace", {}).items()}  # older senders have no trace
        row.update(
            hop_ms=1e3 * (marks["thread_s"] - t0),
            back_ms=1e3 * (t1 - marks["thread_end_s"]),
            e2e_ms=1e3 * (t1 - t0),
            transport_ms=1e3 * stats.seconds,
            notify_ms=1e3 * (done_s - marks["thread_s"]),
            bytes=stats.num_bytes,
        )
        return row


async def run_sizes(pusher: Pusher, sizes_tokens: tuple[int, ...], reps: int, max_blocks: int) -> dict:
    out: dict = {"first_push_ms": None, "sizes": {}}
    first = await pusher.push("first", [0], [0])  # UCX wire-up to the peer
    out["first_push_ms"] = round(first["e2e_ms"], 3)
    for tokens in sizes_tokens:
        n = math.ceil(tokens / CHUNK_TOKENS)
        rows = []
        for rep in range(reps):
            src = list(range(n))
            dst = list(range((rep % 2) * max_blocks, (rep % 2) * max_blocks + n))  # alternate halves
            rows.append(await pusher.push(f"p{tokens}-{rep}", src, dst))
        pusher.conn.send(("digest", dst))
        verified = reply(pusher.conn, "digest")[1] == digest(pusher.sender.pools, src)
        out["sizes"][tokens] = {"rows": rows, "verified": verified}
    return out


def medians(rows: list[dict]) -> dict[str, float]:
    keys = sorted({k for r in rows for k in r})
    return {k: statistics.median(r[k] for r in rows if k in r) for k in keys}


def render(result: dict, args: argparse.Namespace) -> str:
    cols = ["hop_ms", *SEND_PHASES, "back_ms", "e2e_ms", "transport_ms", "notify_ms"]
    head = ["tokens", "MB", *[c.removesuffix("_ms") for c in cols], "GB/s e2e", "GB/s transport", "verified"]
    lines = [
        f"# KV push phases, NIXL/UCX between two processes, pools on {args.device} ({args.label})",
        "",
        f"- `python -m flashpd.bench.transfer_phases --reps {args.reps} --owner-wait-us {args.owner_wait_us} "
        f"--path {args.path} --device {args.device} --loop-thread {args.loop_thread} "
        f"--bind-cuda-context {args.bind_cuda_context} --layout {args.layout}"
        f"{f' --ballast-gb {args.ballast_gb:g} --ballast-chunk-mb {args.ballast_chunk_mb}' if args.ballast_gb else ''}"
        f"{f' --ballast-graphs {args.ballast_graphs}' if args.ballast_graphs else ''}"
        f"{f' --busy-threads {args.busy_threads} --busy-burst-us {args.busy_burst_us} --busy-idle-us {args.busy_idle_us}' if args.busy_threads else ''}"
        f"{f' --switch-interval-us {args.switch_interval_us}' if args.switch_interval_us else ''}"
        f"{' --in-ray-actor' if args.in_ray_actor else ''}"
        f"{f' --before-push {args.before_push} --before-push-ms {args.before_push_ms:g}' if args.before_push != 'none' else ''}"
        f"{' --prepare-ahead' if args.prepare_ahead else ''}`; "
        f"{os.cpu_count()} CPUs shared with other jobs; UCX_NET_DEVICES={os.environ.get('UCX_NET_DEVICES')}",
        f"- first push to the peer (wire-up, not in the medians): {result['first_push_ms']} ms",
        f"- medians of {args.reps} pushes per size, ms (polls: a count); definitions in the module docstring",
        "",
        "| " + " | ".join(head).replace("num_descriptors", "descs") + " |",
        "|" + "---|" * len(head),
    ]
    for tokens, size in result["sizes"].items():
        m = medians(size["rows"])
        cells = [str(tokens), f"{m['bytes'] / 1e6:.1f}"]
        cells += [f"{m[c]:.3f}" if c in m and c not in COUNTS else (f"{m[c]:.0f}" if c in m else "-") for c in cols]
        cells += [f"{m['bytes'] / m['e2e_ms'] / 1e6:.2f}", f"{m['bytes'] / m['transport_ms'] / 1e6:.2f}"]
        cells.append("yes" if size["verified"] else "NO")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def ballast(device: str, gb: float, chunk_mb: int, graphs: int) -> list:
    """What a Serve replica's process holds beside the pools, to reproduce its slower NIXL posts
    (0.23-0.30 ms there against 0.03-0.13 between plain processes on the H200): `gb` GB of
    device memory in `chunk_mb` MB allocations (the model's weights and activations through the
    caching allocator) and `graphs` captured CUDA graphs (the engine's decode and replay graphs).
    Returns the objects to keep alive. CPU: allocations in host memory, no graphs."""
    keep: list = []
    chunk = max(1, chunk_mb) * 2**20
    for _ in range(int(gb * 1e9 // chunk)):
        keep.append(torch.empty(chunk, dtype=torch.uint8, device=device))
    if graphs and device == "cuda":
        x = torch.zeros(1024, device=device)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for _ in range(graphs):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=stream):
                    x.add_(1.0).mul_(0.5)
                keep.append(g)
        torch.cuda.synchronize()
    return keep


def before_push(kind: str, ms: float, device: str):
    """Untimed work before each push, as a prefill replica does before kv_ready: "cpu" runs
    Python and sweeps a 256 MB host buffer for ~ms (the caches a prefill's host work leaves
    cold); "gpu" queues ~ms of matmuls on the pools' device and waits for them with a stream
    synchronize (the engine's wait for the last chunk's kernels). None for "none"."""
    if kind == "none":
        return None
    if kind == "cpu":
        buf = torch.zeros(64 * 2**20, dtype=torch.float32)

        def cpu() -> None:
            end = time.perf_counter() + ms * 1e-3
            while time.perf_counter() < end:
                buf.add_(1.0)

        return cpu
    if kind == "gpu":
        if device != "cuda":
            raise SystemExit("--before-push gpu needs --device cuda")
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        stream = torch.cuda.current_stream()
        t0 = time.perf_counter()
        for _ in range(20):
            a @ a
        stream.synchronize()
        per_ms = max(1e-3, 1e3 * (time.perf_counter() - t0) / 20)
        n = max(1, int(ms / per_ms))

        def gpu() -> None:
            for _ in range(n):
                a @ a
            stream.synchronize()

        return gpu
    raise ValueError(f"--before-push must be none, cpu or gpu, got {kind!r}")


class BusyThreads:
    """`n` daemon threads that each run Python for `burst_s`, then block for `idle_s`, until
    stopped: the GIL contention a replica's own threads put beside the push."""

    def __init__(self, n: int, burst_s: float, idle_s: float):
        self._stop = threading.Event()
        self.bursts = 0
        self._threads = [
            threading.Thread(target=self._run, args=(burst_s, idle_s), daemon=True, name=f"bench-busy-{i}")
            for i in range(n)
        ]

    def _run(self, burst_s: float, idle_s: float) -> None:
        while not self._stop.is_set():
            end, spins = time.perf_counter() + burst_s, 0
            while time.perf_counter() < end:  # Python bytecode: holds the GIL between switches
                spins += 1
            self.bursts += 1
            if idle_s > 0:
                self._stop.wait(idle_s)

    def __enter__(self) -> BusyThreads:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def measure(args: argparse.Namespace) -> dict:
    kept = ballast(args.device, args.ballast_gb, args.ballast_chunk_mb, args.ballast_graphs)  # noqa: F841
    interval = sys.getswitchinterval()
    if args.switch_interval_us:
        sys.setswitchinterval(args.switch_interval_us * 1e-6)
    try:
        with BusyThreads(args.busy_threads, args.busy_burst_us * 1e-6, args.busy_idle_us * 1e-6):
            return _measure(args)
    finally:
        sys.setswitchinterval(interval)


def _measure(args: argparse.Namespace) -> dict:
    max_blocks = math.ceil(max(args.sizes) / CHUNK_TOKENS)
    options = {"bind_cuda_context": args.bind_cuda_context == "on"}
    wait_s = args.owner_wait_us * 1e-6
    with nixl_pair(receiver_main, max_blocks, wait_s, args.device, args.layout, **options) as (sender, conn, _):
        before = before_push(args.before_push, args.before_push_ms, args.device)
        pusher = Pusher(sender, conn, args.path, before, args.prepare_ahead)
        sizes = run_sizes(pusher, tuple(args.sizes), args.reps, max_blocks)
        if args.loop_thread == "main":
            return asyncio.run(sizes)
        with ThreadPoolExecutor(1, thread_name_prefix="bench-loop") as fresh:  # never touched CUDA
            return fresh.submit(asyncio.run, sizes).result()


def _measure_in_ray_actor(args: argparse.Namespace) -> dict:
    """The same measurement with the sender in a Ray actor's process (and the receiver that
    process's child), as the Serve replicas run: the probe saw merged VRAM writes at 1,266 GB/s
    between plain processes and 285 GB/s between Ray actors."""
    import ray

    ray.init(address="local", num_gpus=1 if args.device == "cuda" else 0, include_dashboard=False)
    try:
        gpus = 0.5 if args.device == "cuda" else 0
        actor = ray.remote(num_cpus=0, num_gpus=gpus)(_RayMeasure).remote()
        return ray.get(actor.measure.remote(args))
    finally:
        ray.shutdown()


class _RayMeasure:
    def measure(self, args: argparse.Namespace) -> dict:
        # by module name: under `python -m` this class travels by value, and a spawned
        # receiver must find its target in an importable module, not in __main__
        from flashpd.bench import transfer_phases

        return transfer_phases.measure(args)


def run(args: argparse.Namespace) -> int:
    result = _measure_in_ray_actor(args) if args.in_ray_actor else measure(args)
    table = render(result, args)
    print(table)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "a" if args.append else "w") as f:
            f.write(table + "\n")
    return 0 if all(s["verified"] for s in result["sizes"].values()) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES_TOKENS), help="prompt tokens per push")
    parser.add_argument("--reps", type=int, default=15, help="pushes per size")
    parser.add_argument("--owner-wait-us", type=int, default=5000, help="the receiver owner's idle wait")
    parser.add_argument("--path", choices=("inline", "thread"), default="inline", help="the push path (Pusher)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both sides' pools live")
    parser.add_argument(
        "--loop-thread",
        choices=("main", "fresh"),
        default="main",
        help="run the pushing event loop on the main thread (which made the pools) or a fresh one",
    )
    parser.add_argument(
        "--bind-cuda-context", choices=("on", "off"), default="on", help="NixlSender's bind_cuda_context"
    )
    parser.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="groups",
        help="the pools as the 8 released groups, or the same bytes block-major (one descriptor per run)",
    )
    parser.add_argument("--ballast-gb", type=float, default=0.0, help="device memory held beside the pools (GB)")
    parser.add_argument("--ballast-chunk-mb", type=int, default=256, help="... in allocations of this size")
    parser.add_argument("--ballast-graphs", type=int, default=0, help="CUDA graphs captured before the pushes")
    parser.add_argument("--busy-threads", type=int, default=0, help="Python threads contending for the GIL")
    parser.add_argument("--busy-burst-us", type=int, default=2000, help="... each running Python this long")
    parser.add_argument("--busy-idle-us", type=int, default=500, help="... then blocking this long")
    parser.add_argument(
        "--switch-interval-us", type=int, default=0, help="sys.setswitchinterval for the run (0: leave it)"
    )
    parser.add_argument(
        "--before-push",
        choices=("none", "cpu", "gpu"),
        default="none",
        help="untimed work before each push: cpu (Python + a 256 MB host sweep), gpu (matmuls + a stream sync)",
    )
    parser.add_argument("--before-push-ms", type=float, default=30.0, help="... about this long")
    parser.add_argument(
        "--prepare-ahead", action="store_true", help="build each write before that work, post it after (inline path)"
    )
    parser.add_argument("--in-ray-actor", action="store_true", help="the sender in a Ray actor (Ray started here)")
    parser.add_argument("--label", default="this commit", help="names the run in the table's title")
    parser.add_argument("--out", default="", help="write the markdown table here")
    parser.add_argument("--append", action="store_true", help="append to --out instead of replacing it")
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
