"""Serving-shaped warm-up: synthetic requests through the engine before it takes traffic.

`GpuModel.warmup` compiles the kernels of fixed shapes (the GEMM buckets, a prefill, two decode
sequences) in scratch pools. What it cannot know is the shape of the engine's own steps: the
chunk size, decoder narrowing on a prompt's last rows, prefix hits with their bounded replay and
turn, decode batches padded to each graph bucket, and the kernel variants that switch on with
the context's length (two-stage top-k, sparse candidate scoring) or on a batch of one (Triton
specialises an integer argument equal to 1, or divisible by 16). Measured on the H200 before this (bench preset,
`gpu_engine --summary`): the first request after load compiled 3 variants (6.1 s of its 6.9 s
first token), the next 32K prompts 7, the first decode batches of 8 and 64 another 13; after
it, none on the first request (bench/results/h200/first_request.md).

`warm_up(engine)` runs what the engine will run, in its role, on synthetic token ids:

    colocated / prefill   a long prompt (several chunks, the last one partial) and one of
                          whole 512s, then prefix hits (replay + a short turn), a short prompt
                          (prefill role: the prompt whose hits come next, so each hit's replay
                          and turn run on the encoder path: the encoder replay and encoder turn
                          graphs of every bucket, 2 .. W rows)
    colocated / decode    decode batches of every graph bucket up to max_num_seqs, each for
                          `decode_steps` steps, at the long (aligned) context and at a short
                          one, joined by turns of 2 and 16 tokens after prefix hits; then the
                          largest bucket admitted at once (16-token turns); then one prefix
                          hit with a turn of each turn-graph bucket (2 .. W rows)
    decode role           the same, admitted as the router does (reserve, KV arrived, then a
                          W-row replay with the last row's logits: the pd replay graph)

plus a prefix hit with a turn of each turn-graph bucket on the short prompt (every role), eager
hit turns of more than W rows up to the chunk on a GPU (prefill and colocated: `wide_turn_rows`),
and the speculative drafter's graphs of every batch bucket that may speculate
(`Drafter.warm_up`). Each
graph built is also built at every other context class holding its context (`DecodeGraphs`
width classes), so the short prompt's shapes give every class's decode, replay and turn
graphs (the P/D kinds too: FLASHPD_GRAPH_PD, `DecodeGraphs` PD_KINDS); at the end the engine's
graph set is frozen (`DecodeGraphs.freeze`): a step whose graph is still missing runs eagerly
(counted) instead of capturing on the request path.

then aborts them, drops the prefix cache they made (no chunk of theirs reaches the cache index)
and forgets their records. Returns what it ran (counts, graphs built and seconds).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from flashpd.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

PREFIX = "__warmup-"
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # decode batches (the graph buckets)
# Prompt lengths: the long one is long enough for the long-context variants (two-stage top-k)
# and, with 129 more tokens, ends off every alignment; the short one has fewer compressed
# entries than the indexer's top-k and is a multiple of 512 (Triton specialises integer
# arguments on divisibility by 16: both forms occur in traffic).
LONG_PROMPT = 16_384
SHORT_PROMPT = 512


@dataclass(frozen=True)
class WarmupPlan:
    long_tokens: int
    short_tokens: int
    batches: tuple[int, ...]
    decode_steps: int = 2
    max_steps: int = 10_000  # a bound on engine steps (a warm-up that cannot finish raises)
    # prefill / colocated: eager hit turns of these row counts (more than W rows, no graph),
    # each after a prefix hit on the short prompt (`wide_turn_rows`)
    wide_turns: tuple[int, ...] = ()


WIDE_TURN_GROWTH = 1.6


def wide_turn_rows(window: int, chunk: int) -> tuple[int, ...]:
    """Row counts of the eager hit turns the warm-up runs: from W + 1 up to the chunk, growing
    by WIDE_TURN_GROWTH, each also rounded down to a multiple of 16 (Triton specialises the row
    count on divisibility by 16). The routed experts switch path and tile with the rows per
    expert (gemv, swapab, grouped at 16 / 32 rows, large): a 328-row turn after an 8K hit
    compiled two kernels (3.4 s) on the request path on the H200 before these."""
    out: set[int] = set()
    n = window + 1
    while n < chunk:
        out.add(n)
        if n - n % 16 > window:
            out.add(n - n % 16)
        n = int(n * WIDE_TURN_GROWTH)
    return tuple(sorted(out))


def default_plan(engine) -> WarmupPlan:
    """The engine's shapes: a long prompt of LONG_PROMPT tokens or two chunks, whichever is
    longer, and 129 more, within a quarter of the KV pool and half the positions; decode
    batches of every bucket up to max_num_seqs (and the slots)."""
    cfg, mcfg = engine.config, engine.model.cfg
    block = engine.kv.chunk_tokens
    chunk = cfg.max_num_batched_tokens
    long_tokens = min(max(LONG_PROMPT, 2 * chunk) + 129, cfg.num_blocks * block // 4, mcfg.max_position_embeddings // 2)
    short = min(SHORT_PROMPT, long_tokens)
    top = min(cfg.max_num_seqs, cfg.num_slots - 1, (cfg.num_blocks // 4) // 2)
    # eager hit turns: their kernel variants are a GPU concern (compiles); the CPU path has none
    wide = () if cfg.role == "decode" or "cuda" not in str(cfg.device) else wide_turn_rows(mcfg.sliding_window, chunk)
    return WarmupPlan(long_tokens, short, tuple(b for b in BUCKETS if b <= max(top, 1)), wide_turns=wide)


def warm_up_at_load(engine, plan: WarmupPlan | None = None) -> dict | None:
    """`warm_up` as a server runs it at load: skipped when FLASHPD_ENGINE_WARMUP=0, and a
    failure is logged, not raised (the engine then serves cold: its first requests compile).
    Returns warm_up's record, or None when it did not run to the end."""
    if os.environ.get("FLASHPD_ENGINE_WARMUP", "1") == "0":
        return None
    try:
        done = warm_up(engine, plan)
    except Exception:  # noqa: BLE001 - an optimisation: serve cold rather than not at all
        log.exception("engine warm-up failed; serving without it (first requests compile)")
        return None
    log.info("engine warm-up: %d requests, %d steps, %.1f s", done["requests"], done["steps"], done["seconds"])
    return done


def warm_up(engine, plan: WarmupPlan | None = None) -> dict:
    """Run `plan` (default: `default_plan`) through `engine`; leaves it as it was (no request,
    no cached prefix, no pending cache events). Returns {"requests", "steps", "seconds",
    "long_tokens", "batches"}."""
    plan = default_plan(engine) if plan is None else plan
    run = _Run(engine, plan)
    graphs = getattr(engine.model, "graphs", None)
    before = graphs.counters() if graphs is not None else {}
    t0 = time.perf_counter()
    try:
        run.go()
    finally:
        run.clean()
    if graphs is not None:  # the set is complete: no capture on the request path from now on
        graphs.freeze(engine.pools)
    after = graphs.counters() if graphs is not None else {}
    draft_graphs = 0
    if engine.drafter is not None:  # the drafter's graphs: every batch that may speculate
        draft_graphs = engine.drafter.warm_up(min(engine.spec.max_batch, engine.config.max_num_seqs))
    return {
        "requests": run.count,
        "steps": run.steps,
        "seconds": time.perf_counter() - t0,
        "long_tokens": plan.long_tokens,
        "batches": list(plan.batches),
        "graph_builds": after.get("graph_builds", 0) - before.get("graph_builds", 0),
        "graph_captures": after.get("graph_captures", 0) - before.get("graph_captures", 0),
        "graph_classes": list(graphs.width_classes) if graphs is not None else [],
        "draft_graphs": draft_graphs,
    }


class _Run:
    def __init__(self, engine, plan: WarmupPlan):
        self.engine, self.plan = engine, plan
        self.role = engine.config.role
        vocab = engine.model.cfg.vocab_size
        self.ids = [10 + (i * 7919) % (vocab - 20) for i in range(plan.long_tokens + 64)]
        self.count = self.steps = 0
        # tokens per decoding sequence: enough to stay in the batch through every bucket's
        # admissions and steps (one that ends early only leaves its bucket a row short)
        self.budget = (plan.decode_steps + 16) * len(plan.batches)
        self.live: list[str] = []
        self.all: list[str] = []
        self.done: set[str] = set()  # warm-up requests the engine finished

    # ------------------------------------------------------------------ the plan
    def go(self) -> None:
        p = self.plan
        self.prompt(self.ids[: p.long_tokens])
        aligned = p.long_tokens // 512 * 512
        burst_base = self.ids[: p.long_tokens]
        if aligned and self.role != "decode":  # an aligned prompt of other tokens (no hit)
            burst_base = self.ids[64 : 64 + aligned]
            self.prompt(burst_base)
        short = self.ids[-p.short_tokens :]
        if self.role == "prefill":  # prompts only: a prefix hit with its turn, a short prompt
            self.prompt(self.ids[: p.long_tokens] + [11, 12, 13])
            self.prompt(short)  # cold; cached, so every turn below hits it (the 2-row one too)
            self.turns(short)  # every class's encoder replay and turn graphs (every class holds short)
            self.wide_turns(short)
            return
        for base in (burst_base, short):  # long and short contexts
            self.decode_batches(base)
        self.burst(burst_base)
        self.turns(burst_base)
        self.turns(short)
        if self.role != "decode":
            self.wide_turns(short)

    def decode_batches(self, base: list[int]) -> None:
        """Sequences sharing the prompt `base` (prefix hits after the first), added up to each
        bucket; each bucket decodes `decode_steps` steps with every sequence in it. Turns of 2
        and 16 tokens alternate: after a chunk-aligned hit a sequence adds 128 + 2 or 128 + 16
        rows, a count off and on Triton's divisibility by 16 (a sequence admitted alone)."""
        for b in self.plan.batches:
            while len(self.live) < b:
                i = len(self.live)
                self.add(base + _turn(i, 2 if i % 2 == 0 else 16), max_tokens=self.budget)
            self.decode_all()
        self.end(self.live)

    def burst(self, base: list[int]) -> None:
        """The largest bucket admitted at once, each with a 16-token turn after a prefix hit
        on `base` (a traffic spike: an eager step of many replays and turns, then full-batch
        decode). With the aligned prompt as base each sequence adds 128 + 16 rows."""
        for i in range(self.plan.batches[-1]):
            self.add(base + _turn(i, 16), max_tokens=self.budget)
        self.decode_all()
        self.end(self.live)

    def turns(self, base: list[int]) -> None:
        """A prefix hit on `base` then a turn of each turn-graph bucket (2, 3, 5, ... rows:
        every bucket up to W), one sequence at a time: with the graphs' context classes these
        are every shape a hit takes at any context, so none is captured on the request path."""
        w = self.engine.model.cfg.sliding_window
        for i, n in enumerate([2] + [b // 2 + 1 for b in BUCKETS if 4 <= b <= w]):
            self.prompt(base + _turn(1000 + i, n))

    def wide_turns(self, base: list[int]) -> None:
        """A prefix hit on `base` then an eager turn of each `plan.wide_turns` row count, one
        sequence at a time (new token ids per turn, so each hits `base` only)."""
        for i, n in enumerate(self.plan.wide_turns):
            self.prompt(base + _turn(2000 + i, n))

    def decode_all(self) -> None:
        """Step until every live sequence has its first token, then `decode_steps` steps with
        all of them decoding."""
        self.step_until(lambda: all(self.first_token(r) for r in self.live))
        for _ in range(self.plan.decode_steps):
            self.step()

    # ------------------------------------------------------------------ engine calls
    def add(self, ids: list[int], max_tokens: int) -> str:
        rid = f"{PREFIX}{self.count}"
        self.count += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        if self.role == "decode":
            if self.engine.reserve(rid, ids, params) is None:
                raise RuntimeError(f"warm-up: no room to reserve {len(ids)} tokens")
            self.engine.kv_arrived(rid)  # the pools' contents stand in for a pushed prompt
        else:
            self.engine.add_request(rid, ids, params)
        self.live.append(rid)
        self.all.append(rid)
        return rid

    def prompt(self, ids: list[int]) -> None:
        """One prompt alone, to its first token (prefill role: its KV ready), then ended."""
        rid = self.add(ids, max_tokens=1)
        self.step_until(lambda: self.first_token(rid) or rid in self.done)
        self.end([rid])

    def first_token(self, rid: str) -> bool:
        stats = self.engine.stats.get(rid)
        return stats is not None and stats.first_token_s is not None

    def step(self) -> None:
        self.steps += 1
        if self.steps > self.plan.max_steps:
            raise RuntimeError(f"warm-up did not finish in {self.plan.max_steps} steps")
        for out in self.engine.step():
            if out.error is not None:
                raise RuntimeError(f"warm-up request failed: {out.error}")
            if out.finished:
                self.done.add(out.request_id)

    def step_until(self, pred) -> None:
        while not pred():
            self.step()

    def end(self, rids: list[str]) -> None:
        for rid in list(rids):
            self.engine.abort(rid)
            if rid in self.live:
                self.live.remove(rid)

    def clean(self) -> None:
        """Abort what is left, finish a step launched ahead, drop the prefix cache the warm-up
        made and its cache events, and forget its request records."""
        engine = self.engine
        self.end(self.live)
        while engine.has_unfinished():
            engine.step()
            self.steps += 1
        engine.step()  # completes a step launched ahead whose requests are gone
        self.steps += 1
        engine.kv.reset()
        engine.drain_cache_events()
        for rid in self.all:
            engine.stats.pop(rid, None)


def _turn(i: int, n: int) -> list[int]:
    """n synthetic token ids for the i-th warm-up sequence's turn (distinct across i)."""
    return [11 + (i * 13 + j) % 97 for j in range(n)]
