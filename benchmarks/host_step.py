"""Host time of one graphed decode step, on the CPU, with no model compute.

    python benchmarks/host_step.py --batch 1 8 64 --context 8192 --out bench/results/h200/host.md
    FLASHPD_BENCH_FORCED_ACCEPTANCE=1 python benchmarks/host_step.py --batch 1 8 --spec 3.51

(--spec AL: speculative steps instead, prompt-lookup drafts of 5 with acceptance forced to AL.)
Each batch also prints the torch ops per step outside the zeroed layers (`LaunchCounter`): on a
GPU those on device tensors are kernel launches, the others host work; the count does not move
with the machine's load, the CPU time does.

The engine runs the `bench` preset's layer layout (40 layers, its compress ratios, kv / index /
candidate sources, Engram layers, W=128, top-k 512) at the `tiny` preset's widths, through the
GPU path's decode step (`GpuModel.prepare` + table build, the copies into the graph's static
buffers, `GpuModel.commit`, the scheduler, the runner and the sampler). The one thing replaced
is the layers: `compute` returns zero logits (and the ratio-2 open rows the commit keeps), so
what is timed is the host work of a step. `batch` sequences share a `context`-token prompt
(prefix hits, as `gpu_profile`), then every step decodes one token per sequence.

Caveat: on a CPU the "device" tensors live in host memory, so work that the GPU runs
asynchronously (the commit's ring copies, the sampler's argmax over [B, V], copies into the
static buffers) is executed here, synchronously: the figure is an upper bound of the host time
a GPU step spends (launch cost there is a few microseconds per op, the op itself runs on the GPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from glue_count import NO_KERNEL  # aten ops that launch no device kernel (benchmarks/, beside this script)
from torch.utils._python_dispatch import TorchDispatchMode

from flashpd.engine.gpu.forward import GpuModel
from flashpd.engine.gpu.weights import from_checkpoint_tensors, random_checkpoint_tensors
from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.sampling import SamplingParams
from flashpd.model.engram import EngramHasher
from flashpd.model.presets import preset_config, tokenizer_path


def host_config():
    """The bench preset's layer layout at the tiny preset's widths."""
    bench, tiny = preset_config("bench"), preset_config("tiny")
    return tiny.replace(
        name="host-bench",
        num_layers=bench.num_layers,
        compress_ratios=bench.compress_ratios,
        kv_source_layer_ids=bench.kv_source_layer_ids,
        index_source_layer_ids=bench.index_source_layer_ids,
        candidate_source_layer_id=bench.candidate_source_layer_id,
        candidate_block_size=bench.candidate_block_size,
        candidate_topk_blocks=bench.candidate_topk_blocks,
        index_topk=bench.index_topk,
        sliding_window=bench.sliding_window,
        engram_layer_ids=bench.engram_layer_ids,
        engram_num_embeddings=tiny.engram_num_embeddings[: len(bench.engram_layer_ids)],
        max_position_embeddings=bench.max_position_embeddings,
    )


class HostOnlyModel(GpuModel):
    """`GpuModel` whose layers are not run: zero logits, zero ratio-2 open rows (benchmark)."""

    def compute(self, step):
        cfg = self.cfg
        if self.device.type == "cuda":  # device work inside the graph: expand the key rows
            step.tables.materialise()
        step.outputs = {}
        for src in cfg.kv_source_layer_ids:
            if cfg.compress_ratios[src] == 2:
                rows = step.rows_of(cfg.layers[src])
                step.outputs[("open", src)] = torch.zeros(rows.num_seam, 2, cfg.head_dim, device=self.device)
        n = step.logit_rows.shape[0]
        return torch.zeros(n, cfg.vocab_size, device=self.device) if n else None


def build_model(cfg, device: str = "cpu") -> HostOnlyModel:
    device = torch.device(device)
    weights = from_checkpoint_tensors(cfg, random_checkpoint_tensors(cfg, 0, device), device)
    hasher = EngramHasher.from_tokenizer(cfg, tokenizer_path("tiny"))  # the tiny widths' vocab
    return HostOnlyModel(cfg, weights, hasher, decode_graphs=True)


def start(model, batch: int, context: int, sampling: dict | None = None, spec=None) -> LLMEngine:
    """An engine with `batch` sequences decoding; sampling: extra SamplingParams fields of the
    decoding requests (temperature, top_p, ...; default greedy); spec: a SpeculativeConfig (its
    verify steps are timed instead)."""
    cfg = model.cfg
    engine = LLMEngine(
        model,
        EngineConfig(
            dtype="bfloat16",
            device=str(model.device),
            num_blocks=context // 64 + 16 + 2 * batch,
            num_slots=batch + 4,
            max_num_batched_tokens=8192,
            max_num_seqs=batch,
            model_id="flashpd-host-bench",
            speculative=spec,
        ),
    )
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, cfg.vocab_size - 10, (context,), generator=g).tolist()
    engine.add_request("p", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    rids = [f"r{b}" for b in range(batch)]
    for rid in rids:
        tail = torch.randint(10, cfg.vocab_size - 10, (16,), generator=g).tolist()
        engine.add_request(rid, prompt + tail, SamplingParams(max_tokens=1_000, ignore_eos=True, **(sampling or {})))
    while any(engine.stats[r].first_token_s is None for r in rids):
        engine.step()
    for _ in range(3):  # the decode graph buckets (eager here) and every cache filled
        engine.step()
    return engine


class LaunchCounter(TorchDispatchMode):
    """Torch ops that would launch a device kernel, by op name: outside the (zeroed) layers,
    so each is host glue that a GPU step pays as a launch (~5-10 us) unless it sits in a graph.
    Unlike the CPU time, the count does not move with the machine's load."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL:
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def count_launches(engine: LLMEngine, steps: int) -> tuple[float, dict[str, int]]:
    """Torch launches per step over `steps` steps, and the ten commonest ops."""
    with LaunchCounter() as counter:
        for _ in range(steps):
            engine.step()
    top = dict(sorted(counter.counts.items(), key=lambda kv: -kv[1])[:10])
    return sum(counter.counts.values()) / steps, top


def time_steps(engine: LLMEngine, steps: int) -> tuple[list[float], list[float], float]:
    """(CPU ms of this thread, wall ms) per step, and the tokens per sequence per step. The
    thread's CPU time is the figure: on a shared machine the wall clock also counts the time
    other processes held the core."""
    cpu, wall, tokens, rows = [], [], 0, 0
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        outs = engine.step()
        cpu.append(1e3 * (time.thread_time() - c0))
        wall.append(1e3 * (time.perf_counter() - t0))
        assert outs and all(o.new_token_ids for o in outs), "not a decode step"
        assert engine.spec is not None or all(len(o.new_token_ids) == 1 for o in outs), "not a decode step"
        tokens, rows = tokens + sum(len(o.new_token_ids) for o in outs), rows + len(outs)
    return cpu, wall, tokens / rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: one core)")
    ap.add_argument("--profile", action="store_true", help="cProfile the timed steps")
    ap.add_argument(
        "--device",
        default="cpu",
        help="cuda: the same steps with CUDA graphs (zero-logit graphs: wall time = host time + a near-empty replay)",
    )
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="> 0: requests draw (with --top-p) instead of greedy decoding"
    )
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument(
        "--spec",
        type=float,
        default=None,
        metavar="AL",
        help="speculative steps instead: prompt-lookup drafts of 5, acceptance forced to AL (needs "
        "FLASHPD_BENCH_FORCED_ACCEPTANCE=1, the benchmark flag)",
    )
    ap.add_argument("--out", default=None, help="append a markdown table to this file")
    args = ap.parse_args(argv)
    spec = None
    if args.spec is not None:
        from flashpd.engine.speculative import SpeculativeConfig

        spec = SpeculativeConfig(num_tokens=5, max_batch=max(args.batch), bench_forced_acceptance_length=args.spec)
    sampling = {"temperature": args.temperature, "top_p": args.top_p}
    torch.set_num_threads(args.threads)
    model = build_model(host_config(), args.device)
    rows = []
    for batch in args.batch:
        engine = start(model, batch, args.context, sampling, spec)
        if args.profile:
            import cProfile
            import pstats

            pr = cProfile.Profile()
            pr.enable()
            time_steps(engine, args.steps)
            pr.disable()
            pstats.Stats(pr).sort_stats(os.environ.get("HOST_STEP_SORT", "tottime")).print_stats(25)
        cpu, wall, per_step = time_steps(engine, args.steps)
        launches, top = count_launches(engine, args.steps)
        med, p10, wmed = statistics.median(cpu), sorted(cpu)[len(cpu) // 10], statistics.median(wall)
        rows.append((batch, med, p10, wmed, per_step, launches))
        print(
            f"B={batch}: host CPU ms/step median {med:.2f} (p10 {p10:.2f}; wall median "
            f"{wmed:.2f}) over {args.steps} steps, {per_step:.2f} tokens per sequence per step, "
            f"{launches:.0f} torch launches per step (top: {top})",
            flush=True,
        )
    if args.out:
        kind = f"speculative (forced AL {args.spec})" if spec is not None else "decode"
        lines = [
            f"| B | {kind}: host CPU ms/step (median) | p10 | wall ms (median) | tokens/seq/step | torch launches/step |",
            "|---|---|---|---|---|---|",
        ]
        lines += [f"| {b} | {m:.2f} | {p:.2f} | {x:.2f} | {t:.2f} | {n:.0f} |" for b, m, p, x, t, n in rows]
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
