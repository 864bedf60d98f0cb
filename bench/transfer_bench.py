"""NIXL KV transfer throughput between two processes of one machine.

Moves the global KV of one long prompt (default 100K tokens at 890 B/token, the released
config's 8 groups) from a sender in this process into a receiver in a spawned process, several
times per block pattern, and reports latency percentiles and throughput:

    python -m flashpd.bench.transfer_bench --tokens 100000 --reps 10 \
        --out bench/results/transfer_cpu.md

Two latencies per repetition, both from just before `send`:
  - sender: until the sender's `wait` observes the WRITE complete;
  - notify: until the receiver's `poll_completed` reports the request (time.monotonic is one
    clock for both processes on Linux).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import multiprocessing as mp
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from flashpd.engine.transfer import GroupSpec, TransferContract
from flashpd.engine.transfer.contract import CHUNK_TOKENS

MODEL_ID = "deepseek-ai/DeepSeek-V4.1-Flash"
# Released config: KV sources (layer, compress ratio); NVFP4 main records and MXFP4 index keys.
KV_SOURCES = ((2, 2), (8, 2), (14, 2), (20, 1))
MAIN_ENTRY_BYTES, INDEX_ENTRY_BYTES = 288, 68
REPLY_TIMEOUT_S = 120.0


def released_contract() -> TransferContract:
    """8 groups; one block = 128 tokens = 128 / ratio entries of each source -> 890 B/token."""
    groups = []
    for layer, ratio in KV_SOURCES:
        entries = CHUNK_TOKENS // ratio
        groups.append(GroupSpec(f"main.L{layer}", entries * MAIN_ENTRY_BYTES, "nvfp4_e4m3x16"))
        groups.append(GroupSpec(f"index.L{layer}", entries * INDEX_ENTRY_BYTES, "mxfp4_ue8m0x32"))
    return TransferContract(MODEL_ID, tuple(groups))


LAYOUTS = ("groups", "block_major")


def layout_contract(layout: str) -> TransferContract:
    """The released contract ("groups": 8 pools, one descriptor per group and run), or the same
    bytes as one group of 113,920-byte blocks ("block_major": every group of a block adjacent,
    one descriptor per run), to measure what merging the 8 descriptors would buy."""
    contract = released_contract()
    if layout == "groups":
        return contract
    if layout != "block_major":
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    block = GroupSpec("blocks", contract.bytes_per_block, "+".join(sorted({g.record_format for g in contract.groups})))
    return TransferContract(MODEL_ID, (block,))


def digest(pools: dict[str, torch.Tensor], block_ids: list[int]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(pools):
        h.update(pools[name][block_ids].cpu().numpy().tobytes())
    return h.hexdigest()


def receiver_main(conn, contract_json: str, num_blocks: int, poll_interval_s: float, device: str = "cpu") -> None:
    """Child process: a NixlReceiver that reports ("done", request_id, monotonic time)."""
    from flashpd.engine.transfer.nixl_backend import NixlReceiver

    contract = TransferContract.from_json(contract_json)
    pools = {g.name: torch.zeros(num_blocks, g.block_bytes, dtype=torch.uint8, device=device) for g in contract.groups}
    receiver = NixlReceiver(contract, pools, incarnation="bench-decode")
    conn.send(receiver.descriptor())
    while True:
        for request_id in receiver.poll_completed():
            conn.send(("done", request_id, time.monotonic()))
        if not conn.poll(poll_interval_s):
            continue
        command, *args = conn.recv()
        if command == "stop":
            break
        if command == "expect":
            request_id, block_ids = args
            receiver.expect(request_id, block_ids, time.monotonic() + 600, "bench-prefill")
            conn.send(("ok",))
        elif command == "digest":
            conn.send(("digest", digest(receiver.pools, args[0])))
    receiver.close()


@dataclass(frozen=True)
class Row:
    pattern: str
    payload_mb: float
    reps: int
    sender_ms: list[float]
    notify_ms: list[float]
    verified: bool

    def cells(self) -> list[str]:
        p50, p90 = np.percentile(self.sender_ms, [50, 90])
        n50 = float(np.percentile(self.notify_ms, 50))
        return [
            self.pattern,
            f"{self.payload_mb:.1f}",
            str(self.reps),
            f"{p50:.1f}",
            f"{p90:.1f}",
            f"{self.payload_mb / (p50 / 1e3):.0f}",
            f"{n50:.1f}",
            f"{self.payload_mb / (n50 / 1e3):.0f}",
            "yes" if self.verified else "NO",
        ]


def reply(conn, kind: str):
    if not conn.poll(REPLY_TIMEOUT_S):
        raise TimeoutError(f"receiver sent no {kind!r} within {REPLY_TIMEOUT_S} s")
    message = conn.recv()
    if message[0] != kind:
        raise RuntimeError(f"expected {kind!r} from receiver, got {message!r}")
    return message


def run_pattern(sender, conn, pattern: str, num_blocks: int, reps: int, seed: int) -> Row:
    """One warm-up plus `reps` timed transfers; block ids change every repetition."""
    rng = np.random.default_rng(seed)
    sender_ms, notify_ms = [], []
    for rep in range(reps + 1):
        if pattern == "contiguous":
            src = np.arange(num_blocks)
            dst = np.arange(num_blocks) + (rep % 2) * num_blocks  # alternate halves
        else:
            src = rng.permutation(sender.num_blocks)[:num_blocks]
            dst = rng.permutation(2 * num_blocks)[:num_blocks]
        request_id = f"{pattern}-{rep}"
        conn.send(("expect", request_id, dst.tolist()))
        reply(conn, "ok")
        started_s = time.monotonic()
        stats = sender.wait(sender.send(request_id, src, dst, "bench-prefill"), timeout_s=60)
        _, done_id, done_s = reply(conn, "done")
        assert done_id == request_id, (done_id, request_id)
        if rep > 0:  # rep 0 warms up connections and pages
            sender_ms.append(stats.seconds * 1e3)
            notify_ms.append((done_s - started_s) * 1e3)
    conn.send(("digest", dst.tolist()))
    verified = reply(conn, "digest")[1] == digest(sender.pools, src.tolist())
    payload_mb = num_blocks * sender.contract.bytes_per_block / 1e6
    return Row(pattern, payload_mb, reps, sender_ms, notify_ms, verified)


def render(rows: list[Row], args: argparse.Namespace, contract: TransferContract) -> str:
    head = [
        "pattern",
        "payload MB",
        "reps",
        "sender p50 ms",
        "sender p90 ms",
        "MB/s @p50",
        "notify p50 ms",
        "MB/s @notify p50",
        "bytes verified",
    ]
    lines = [
        "# NIXL KV transfer, two processes on one host (CPU DRAM)",
        "",
        f"- payload: {args.tokens} tokens x {contract.bytes_per_block / CHUNK_TOKENS:.0f} B/token "
        f"= {math.ceil(args.tokens / CHUNK_TOKENS)} blocks x {len(contract.groups)} groups "
        f"({contract.bytes_per_block} B per 128-token block)",
        f"- host: {os.cpu_count()} CPUs (shared with other jobs); UCX_TLS="
        f"{os.environ.get('UCX_TLS', '(default)')}, UCX_NET_DEVICES="
        f"{os.environ.get('UCX_NET_DEVICES')}; no NIXL progress thread, receiver polls every "
        f"{args.poll_interval_us} us",
        "- sender: post -> sender observes WRITE done; notify: post -> receiver reports the request complete",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def nixl_pair(
    receiver_target, num_blocks: int, wait_s: float, device: str = "cpu", layout: str = "groups", **sender_options
):
    """(sender, pipe, contract): a NixlSender over random pools of `num_blocks` blocks per group
    on `device` (VRAM pools on "cuda"), connected to a receiver process running
    `receiver_target(conn, contract_json, 2 * num_blocks, wait_s, device)`; the receiver is
    stopped and the sender closed on exit."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # loopback only
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from flashpd.engine.transfer.nixl_backend import NixlSender

    contract = layout_contract(layout)
    ctx = mp.get_context("spawn")
    conn, child_end = ctx.Pipe()
    child = ctx.Process(
        target=receiver_target, daemon=True, args=(child_end, contract.to_json(), 2 * num_blocks, wait_s, device)
    )
    child.start()
    gen = torch.Generator().manual_seed(0)
    pools = {
        g.name: torch.randint(0, 256, (num_blocks, g.block_bytes), dtype=torch.uint8, generator=gen).to(device)
        for g in contract.groups
    }
    sender = NixlSender(contract, pools, **sender_options)
    try:
        if not conn.poll(REPLY_TIMEOUT_S):
            raise TimeoutError("receiver process did not start")
        sender.connect(conn.recv())
        yield sender, conn, contract
    finally:
        conn.send(("stop",))
        child.join(timeout=30)
        sender.close()


def run(args: argparse.Namespace) -> int:
    num_blocks = math.ceil(args.tokens / CHUNK_TOKENS)
    with nixl_pair(receiver_main, num_blocks, args.poll_interval_us * 1e-6) as (sender, conn, contract):
        rows = [
            run_pattern(sender, conn, pattern, num_blocks, args.reps, seed=i)
            for i, pattern in enumerate(("contiguous", "scattered"))
        ]
    table = render(rows, args, contract)
    print(table)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(table)
    return 0 if all(row.verified for row in rows) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000, help="prompt tokens to move")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per pattern")
    parser.add_argument("--poll-interval-us", type=int, default=100, help="receiver's wait between polls")
    parser.add_argument("--out", default="", help="write the markdown table here")
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
