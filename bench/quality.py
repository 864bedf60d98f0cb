"""Quality cost of the lossy optimizations on held-out ShareGPT conversations (small checkpoint).

    python -m flashpd.bench.quality [--checkpoint DIR] [--conversations 24] [--engine-conversations 16]

Held-out = the thread-hash split of flashpd.model.train_data (never trained on). Each
conversation contributes its first `--seq-len` tokens of chat text.

Teacher-forced (the model's public forward, `Model.run`, FP32 compute, CPU):
  - compressed-KV formats: BF16 compressed KV and index keys (a `quant` kernel set registered
    here whose index/compressed fake quants round to BF16) vs the 890 B/token form (NVFP4
    compressed KV + MXFP4 index keys, the trained format) vs FP8 compressed KV (+ MXFP4 keys);
    NLL of every next token and top-1 agreement with the BF16 reference;
  - bounded replay after H tokens of global KV (H = 256, 384, 512): the state holds only the
    global KV of [0, H) (what a prefix hit's cached blocks, or a prefill worker's transfer,
    provide: `SeqPlan.encoder_only()`), the windows are rebuilt by replaying the last W = 128
    tokens (`replay_segment`), then [H, T) runs on all layers; vs the cold run, which the exact
    replay (replay off) reproduces bit for bit. Scored on the positions after H.

Generated (the engine's public API, greedy, `--gen-tokens` tokens, FP32, CPU):
  - colocated prefix hit: request 1 caches seq[:H], request 2 = seq[:H + 64] hits it; replay on
    (128 rows) vs off (exact receptive field);
  - disaggregated decode side: PrefillWorker -> local KV transfer -> DecodeWorker (the services'
    workers in one process), replay on vs off, prompt seq[:H + 64];
  - colocated vs disaggregated as served (replay on both; colocated narrows its decoder layers
    to the prompt's last 128 rows): the same prompt, no prefix hit.
  Agreement = fraction of generated positions whose token equals the reference's.

Statistics: per conversation a value (mean NLL over its scored tokens, or an agreement); the
delta is the paired per-conversation difference; SE(metric) is the spread of the reference's
per-conversation values / sqrt(n) (the seed's bar: a benchmark score's standard error) and
SE(delta) the paired standard error. Verdict "within 1.5 SE": |mean delta| <= 1.5 SE(metric) (the
seed's bar), and the stricter |mean delta| <= 1.5 SE(delta); agreement rows (reference 1 by
definition) use SE(delta) only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from flashpd.kernels import dispatch
from flashpd.kernels.quant import ref as qref
from flashpd.model.kv_format import CompressedKVFormat

HITS = (256, 384, 512)
TAIL = 64  # prompt tokens after the hit in the generated comparisons
BF16_KV = CompressedKVFormat("bf16", "fake_quant_bf16", "pack_bf16", "unpack_bf16", value_bits=16, scale_group=0)
BF16_QUANT_IMPL = "bf16-kv"


def _to_bf16(x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def register_bf16_kv_quant() -> str:
    """A `quant` kernel set = the reference with BF16 index keys/queries and a BF16 KV format."""
    mod = types.ModuleType("flashpd_bf16_kv_quant")
    mod.__dict__.update({k: getattr(qref, k) for k in dir(qref) if not k.startswith("__")})
    mod.fake_quant_mxfp4 = _to_bf16
    mod.fake_quant_bf16 = _to_bf16
    dispatch.register("quant", BF16_QUANT_IMPL, mod, replace=True)
    return BF16_QUANT_IMPL


# ============================================================================ statistics
@dataclass
class Paired:
    """Per-conversation values of a reference and a variant."""

    name: str
    ref: list[float] = field(default_factory=list)
    var: list[float] = field(default_factory=list)

    def add(self, ref: float, var: float) -> None:
        self.ref.append(ref)
        self.var.append(var)

    def summary(self) -> dict:
        n = len(self.ref)
        deltas = [v - r for r, v in zip(self.ref, self.var, strict=True)]
        se = lambda xs: statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")  # noqa: E731
        mean_d = statistics.fmean(deltas) if deltas else float("nan")
        se_metric = se(self.ref)
        return {
            "name": self.name,
            "n": n,
            "ref": statistics.fmean(self.ref) if n else None,
            "var": statistics.fmean(self.var) if n else None,
            "delta": mean_d,
            "se_metric": se_metric,
            "se_delta": se(deltas),
            "within": bool(abs(mean_d) <= 1.5 * se_metric) if n > 1 else None,
        }


def agreement(a: Sequence[int], b: Sequence[int]) -> float:
    n = max(len(a), len(b))
    return sum(x == y for x, y in zip(a, b, strict=False)) / n if n else 1.0


# ============================================================================ teacher-forced
def nll_and_argmax(logits: torch.Tensor, ids: Sequence[int], first: int) -> tuple[list, list]:
    """logits [n, V] for positions first-1 .. ; NLL of ids[first:], argmax per position."""
    target = torch.tensor(ids[first:], dtype=torch.long)
    lp = torch.log_softmax(logits.float(), -1)
    nll = (-lp[torch.arange(len(target)), target]).tolist()
    return nll, lp.argmax(-1).tolist()


def full_logits(model, ids: Sequence[int]) -> torch.Tensor:
    from flashpd.model.model import LogitsRequest, SeqPlan

    return model.run(model.new_state(), ids, SeqPlan(logits=LogitsRequest.ALL))


def replayed_logits(model, ids: Sequence[int], hit: int) -> torch.Tensor:
    """Global KV of [0, hit) only, bounded replay of the last W tokens, then [hit, T) in full.
    Returns logits for positions hit-1 .. T-2 (predicting hit .. T-1)."""
    from flashpd.model.model import LogitsRequest, SeqPlan, replay_segment

    state = model.new_state()
    model.run(state, ids[:hit], SeqPlan.encoder_only())
    last = model.run_replay(state, replay_segment(ids, hit, model.cfg.sliding_window))
    rest = model.run(state, ids[hit:-1], SeqPlan(logits=LogitsRequest.ALL))
    return torch.cat((last, rest))


def colocated_logits(model, ids: Sequence[int], prompt_len: int) -> torch.Tensor:
    """The colocated engine with replay on: the prompt in one chunk whose decoder layers run only
    on its last W rows (decoder narrowing), then [prompt_len, T) in full. Logits as above."""
    from flashpd.model.model import LogitsRequest, SeqPlan

    state = model.new_state()
    last = model.run(state, ids[:prompt_len], SeqPlan(logits=LogitsRequest.LAST, decoder_rows=model.cfg.sliding_window))
    rest = model.run(state, ids[prompt_len:-1], SeqPlan(logits=LogitsRequest.ALL))
    return torch.cat((last, rest))


def teacher_forced(ckpt_dir: str, seqs: list[list[int]], hits: Sequence[int], log) -> dict:
    from flashpd.model.checkpoint import load_checkpoint
    from flashpd.model.model import Model

    ckpt = load_checkpoint(ckpt_dir)
    models = {
        "bf16": Model.from_checkpoint(
            ckpt, torch.float32, {"quant": register_bf16_kv_quant()}, compressed_kv_format=BF16_KV
        ),
        "nvfp4": Model.from_checkpoint(ckpt, torch.float32, compressed_kv_format="nvfp4"),
        "fp8": Model.from_checkpoint(ckpt, torch.float32, compressed_kv_format="fp8"),
    }
    fmt = {k: Paired(k) for k in ("nvfp4", "fp8")}
    fmt_agree = {k: Paired(k) for k in ("nvfp4", "fp8")}
    ppl_tokens: dict[str, list[float]] = {k: [] for k in models}
    rep = {h: Paired(f"replay@{h}") for h in hits}
    rep_agree = {h: Paired(f"replay@{h}") for h in hits}
    col = {h: Paired(f"colocated@{h} vs cold") for h in hits}
    pdc = {h: Paired(f"disaggregated vs colocated @{h}") for h in hits}
    pdc_agree = {h: Paired(f"disaggregated vs colocated @{h}") for h in hits}
    for i, ids in enumerate(seqs):
        t0 = time.time()
        out = {}
        for name, model in models.items():
            nll, top = nll_and_argmax(full_logits(model, ids)[:-1], ids, 1)
            out[name] = (nll, top)
            ppl_tokens[name].extend(nll)
        ref_nll, ref_top = out["bf16"]
        for name in ("nvfp4", "fp8"):
            fmt[name].add(statistics.fmean(ref_nll), statistics.fmean(out[name][0]))
            fmt_agree[name].add(1.0, agreement(ref_top, out[name][1]))
        cold_nll, cold_top = out["nvfp4"]  # the served format is the replay baseline
        for h in hits:
            nll, top = nll_and_argmax(replayed_logits(models["nvfp4"], ids, h), ids, h)
            rep[h].add(statistics.fmean(cold_nll[h - 1 :]), statistics.fmean(nll))
            rep_agree[h].add(1.0, agreement(cold_top[h - 1 :], top))
            c_nll, c_top = nll_and_argmax(colocated_logits(models["nvfp4"], ids, h), ids, h)
            col[h].add(statistics.fmean(cold_nll[h - 1 :]), statistics.fmean(c_nll))
            pdc[h].add(statistics.fmean(c_nll), statistics.fmean(nll))
            pdc_agree[h].add(1.0, agreement(c_top, top))
        log(f"teacher-forced {i + 1}/{len(seqs)} ({time.time() - t0:.1f} s)")
    return {
        "ppl": {k: math.exp(statistics.fmean(v)) for k, v in ppl_tokens.items()},
        "tokens": len(ppl_tokens["bf16"]),
        "formats": [fmt[k].summary() for k in fmt],
        "formats_agreement": [fmt_agree[k].summary() for k in fmt_agree],
        "replay": [rep[h].summary() for h in hits],
        "replay_agreement": [rep_agree[h].summary() for h in hits],
        "colocated": [col[h].summary() for h in hits],
        "pd_vs_colocated": [pdc[h].summary() for h in hits],
        "pd_vs_colocated_agreement": [pdc_agree[h].summary() for h in hits],
    }


# ============================================================================ generated (engine)
def _engine(model, role: str = "colocated", replay: bool = True):
    from flashpd.engine.llm_engine import EngineConfig, LLMEngine

    return LLMEngine(
        model, EngineConfig(role=role, num_blocks=64, num_slots=8, swa_bounded_replay=replay, model_id="quality")
    )


def _generate(engine, rid: str, prompt: Sequence[int], n: int) -> tuple[list[int], int]:
    from flashpd.engine.sampling import SamplingParams

    engine.add_request(rid, list(prompt), SamplingParams(max_tokens=n, ignore_eos=True))
    out, cached = [], 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                out.extend(o.new_token_ids)
                cached = max(cached, o.cached_tokens)
    return out, cached


def colocated_after_hit(model, ids: Sequence[int], hit: int, n: int, replay: bool) -> list[int]:
    engine = _engine(model, replay=replay)
    _generate(engine, "warm", ids[:hit], 1)
    out, cached = _generate(engine, "hit", ids[: hit + TAIL], n)
    if replay and cached == 0:  # with replay off the credit can be 0: that run is cold (= exact)
        raise RuntimeError(f"expected a prefix hit after caching {hit} tokens")
    return out


async def _disaggregated(model, prompt: Sequence[int], n: int, replay: bool) -> list[int]:
    from flashpd.engine.llm_engine import EngineConfig, LLMEngine
    from flashpd.services.api import InternalRequest, SamplingParams, TokenEvent
    from flashpd.services.decode.server import DecodeWorker
    from flashpd.services.prefill.server import PrefillWorker
    from flashpd.services.worker.common import WorkerConfig, new_worker_ref

    def role(name):
        ec = EngineConfig(role=name, num_blocks=64, num_slots=8, swa_bounded_replay=replay, model_id="quality")
        return LLMEngine(model, ec), WorkerConfig(
            "unused", "quality", ec, transfer_backend="local", transfer_timeout_s=60.0
        )

    p = PrefillWorker(*role("prefill"), new_worker_ref("prefill"))
    d = DecodeWorker(*role("decode"), new_worker_ref("decode"))
    try:
        req = InternalRequest("q", "quality", tuple(prompt), SamplingParams(max_tokens=n, ignore_eos=True))
        ticket = await d.reserve(req)
        if ticket.needs_prefill:
            await p.run(req, ticket)
        ids = []
        async for ev in d.generate(req):
            if isinstance(ev, TokenEvent):
                ids.extend(ev.token_ids)
        return ids
    finally:
        await p.close()
        await d.close()


def disaggregated(model, prompt: Sequence[int], n: int, replay: bool) -> list[int]:
    return asyncio.run(_disaggregated(model, prompt, n, replay))


def generated(ckpt_dir: str, seqs: list[list[int]], hits: Sequence[int], n: int, log) -> dict:
    from flashpd.model.model import load_model

    model = load_model(ckpt_dir, torch.float32)
    hit_on = {h: Paired(f"colocated hit@{h}") for h in hits}
    dec_on = {h: Paired(f"decode side, prompt {h + TAIL}") for h in hits}
    pd = {h: Paired(f"disaggregated vs colocated, prompt {h + TAIL}") for h in hits}
    for i, ids in enumerate(seqs):
        t0 = time.time()
        for h in hits:
            prompt = ids[: h + TAIL]
            # replay off reproduces the cold run bit for bit (tests/engine): it is the reference
            exact = colocated_after_hit(model, ids, h, n, replay=False)
            bounded = colocated_after_hit(model, ids, h, n, replay=True)
            hit_on[h].add(1.0, agreement(exact, bounded))
            d_exact = disaggregated(model, prompt, n, replay=False)
            d_bounded = disaggregated(model, prompt, n, replay=True)
            dec_on[h].add(1.0, agreement(d_exact, d_bounded))
            served, _ = _generate(_engine(model, replay=True), "cold", prompt, n)
            pd[h].add(1.0, agreement(served, d_bounded))
        log(f"generated {i + 1}/{len(seqs)} ({time.time() - t0:.1f} s)")
    return {
        "colocated_hit": [hit_on[h].summary() for h in hits],
        "decode_side": [dec_on[h].summary() for h in hits],
        "pd_vs_colocated": [pd[h].summary() for h in hits],
    }


# ============================================================================ data
def heldout_sequences(tokenizer_path: str, n: int, seq_len: int) -> list[list[int]]:
    """The first n held-out conversations whose chat text has >= seq_len tokens, cut there."""
    from tokenizers import Tokenizer

    from flashpd.model import train_data

    tok = Tokenizer.from_file(tokenizer_path)
    _, held = train_data.split(train_data.load_conversations())
    out = []
    for conv in held:
        ids = tok.encode(train_data.chat_text(conv), add_special_tokens=False).ids
        if len(ids) >= seq_len:
            out.append(ids[:seq_len])
        if len(out) == n:
            break
    return out


# ============================================================================ report
def _fmt(x, digits=4) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _verdict(s: dict, se_key: str) -> str:
    d, se = s["delta"], s[se_key]
    if s["n"] < 2 or d is None or se is None or math.isnan(se):
        return "-"
    return "yes" if abs(d) <= 1.5 * se else "no"


def _rows(summaries: list[dict], unit: str) -> list[str]:
    """NLL rows: the seed's bar uses SE(metric), the paired SE is the stricter test. Agreement
    rows (reference 1 by definition, SE(metric) 0): only the paired SE applies."""
    agree = unit == "agreement"
    out = []
    for s in summaries:
        verdict = f"{_verdict(s, 'se_delta')}" if agree else f"{_verdict(s, 'se_metric')} / {_verdict(s, 'se_delta')}"
        out.append(
            f"| {s['name']} | {s['n']} | {_fmt(s['ref'])} | {_fmt(s['var'])} | "
            f"{_fmt(s['delta'])} | {_fmt(s['se_metric'])} | {_fmt(s['se_delta'])} | "
            f"{verdict} |"
        )
    bar = "within 1.5 SE(delta)" if agree else "within 1.5 SE(metric) / 1.5 SE(delta)"
    head = [
        f"| variant | n | reference {unit} | variant {unit} | delta | SE(metric) | SE(delta, paired) | {bar} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    return head + out


def _summary(tf: dict, gen: dict | None) -> list[str]:
    """One line per optimization: its NLL delta against the seed's bar and the paired SE."""
    named = [
        ("NVFP4 compressed KV + MXFP4 index keys (890 B/token) vs BF16 KV", tf["formats"][0]),
        ("FP8 compressed KV vs BF16 KV", tf["formats"][1]),
    ]
    named += [
        (f"bounded replay after a prefix hit / P->D handoff at {s['name'].split('@')[1]} tokens vs replay off", s)
        for s in tf["replay"]
    ]
    named += [
        (f"disaggregated vs colocated, prompt {s['name'].split('@')[1]}", s) for s in tf.get("pd_vs_colocated", [])
    ]
    out = ["## Summary (held-out NLL per token; the seed's bar is |delta| <= 1.5 SE)", ""]
    for label, s in named:
        out.append(
            f"- {label}: delta {s['delta']:+.4f} nats (SE {s['se_metric']:.4f}; paired SE "
            f"{s['se_delta']:.4f}) -> {'within' if _verdict(s, 'se_metric') == 'yes' else 'outside'}"
            f" 1.5 SE; {'also' if _verdict(s, 'se_delta') == 'yes' else 'not'} within 1.5 "
            "paired SE."
        )
    agree = [
        s["var"] for k in ("formats_agreement", "replay_agreement", "pd_vs_colocated_agreement") for s in tf.get(k, [])
    ]
    out += [
        "",
        f"Teacher-forced top-1 agreement per position: {100 * min(agree):.1f}-"
        f"{100 * max(agree):.1f}% (tables below); a lossy step flips the argmax where the "
        "top logits nearly tie.",
    ]
    if gen:
        out += [
            "Free-running greedy text (last section) compounds each flip, so its "
            "position-wise agreement is lower than the teacher-forced one."
        ]
    return out + [""]


def render(result: dict) -> str:
    tf, gen, meta = result.get("teacher_forced"), result.get("generated"), result["meta"]
    lines = [
        "# Quality of the lossy optimizations on held-out ShareGPT (small checkpoint)",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Checkpoint `{meta['checkpoint']}`; held-out conversations (thread-hash split, never "
        f"trained on), first {meta['seq_len']} tokens of each; FP32 compute on CPU. "
        "Deltas are variant minus reference, averaged over conversations; SE(metric) is the "
        "standard error of the reference metric over conversations (the seed's bar: within "
        "about 1.5 of it), SE(delta) the paired standard error of the difference.",
        "",
    ]
    if tf:
        lines += _summary(tf, gen)
    if tf:
        ppl = tf["ppl"]
        lines += [
            "## Compressed-KV formats (teacher-forced, every next token)",
            "",
            f"Held-out perplexity over {tf['tokens']} tokens: BF16 KV {ppl['bf16']:.3f}, "
            f"NVFP4 + MXFP4 index keys (890 B/token released) {ppl['nvfp4']:.3f}, "
            f"FP8 compressed KV {ppl['fp8']:.3f}.",
            "",
            "Mean NLL per token (nats), reference BF16 KV:",
            "",
        ]
        lines += _rows(tf["formats"], "NLL")
        lines += ["", "Top-1 (greedy) agreement with BF16 KV, per position:", ""]
        lines += _rows(tf["formats_agreement"], "agreement")
        lines += [
            "",
            "## Bounded replay after H tokens of global KV (teacher-forced, positions after H)",
            "",
            "Reference: the cold run (= replay off: the exact replay reproduces it bit for "
            "bit). Variant: global KV of [0, H) only, windows rebuilt from the last 128 "
            "tokens. At the model level this is both a prefix hit of H tokens and the "
            "decode side of a P->D handoff at prompt length H.",
            "",
        ]
        lines += _rows(tf["replay"], "NLL")
        lines += [""]
        lines += _rows(tf["replay_agreement"], "agreement")
        lines += [""]
        if "colocated" in tf:
            lines += [
                "## Colocated vs disaggregated (teacher-forced, positions after the prompt)",
                "",
                "Colocated as served with replay on: the prompt of H tokens in one "
                "chunk, decoder layers narrowed to its last 128 rows; then the reply in "
                "full. Against the cold run:",
                "",
            ]
            lines += _rows(tf["colocated"], "NLL")
            lines += [
                "",
                "Disaggregated (encoder-only prompt, decode-side replay of 128 tokens) against colocated (reference):",
                "",
            ]
            lines += _rows(tf["pd_vs_colocated"], "NLL")
            lines += [""]
            lines += _rows(tf["pd_vs_colocated_agreement"], "agreement")
            lines += [""]
    if gen:
        lines += [
            f"## Generated text through the engine (greedy, {meta['gen_tokens']} tokens)",
            "",
            "Agreement = fraction of generated positions equal to the reference's tokens "
            "(reference 1.0 by definition).",
            "",
            "Colocated engine, prefix hit of H tokens, prompt H + 64: replay on vs off:",
            "",
        ]
        lines += _rows(gen["colocated_hit"], "agreement")
        lines += [
            "",
            "Disaggregated (PrefillWorker -> local KV transfer -> DecodeWorker), decode side replay on vs off:",
            "",
        ]
        lines += _rows(gen["decode_side"], "agreement")
        lines += ["", "Colocated vs disaggregated as served (replay on both, no prefix hit):", ""]
        lines += _rows(gen["pd_vs_colocated"], "agreement")
        lines += [""]
    lines += [f"Wall time: {meta['seconds']:.0f} s.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None, help="default: the shipped small checkpoint")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--engine-conversations", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=640)
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--hits", default=",".join(map(str, HITS)))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench/results/quality.md")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--render-json", default=None, help="only re-render --out from a results JSON written by --json")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.render_json:
        with open(args.render_json) as f:
            result = json.load(f)
        with open(args.out, "w") as f:
            f.write(render(result))
        print(f"wrote {args.out}")
        return 0
    torch.set_num_threads(args.threads)
    if args.checkpoint is None:
        from flashpd.model.presets.small import checkpoint_path

        args.checkpoint = checkpoint_path()
    hits = tuple(int(h) for h in args.hits.split(","))
    if any(h % 128 or h + TAIL > args.seq_len for h in hits):
        raise SystemExit(f"--hits must be multiples of 128 with hit + {TAIL} <= --seq-len")
    t0 = time.time()
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    n_seq = max(args.conversations, args.engine_conversations)
    seqs = heldout_sequences(os.path.join(args.checkpoint, "tokenizer.json"), n_seq, args.seq_len)
    result: dict = {}
    if args.conversations:
        result["teacher_forced"] = teacher_forced(args.checkpoint, seqs[: args.conversations], hits, log)
    if args.engine_conversations:
        result["generated"] = generated(args.checkpoint, seqs[: args.engine_conversations], hits, args.gen_tokens, log)
    cmd = "python -m flashpd.bench.quality" + (" " + " ".join(argv) if argv else "")
    result["meta"] = {
        "command": cmd,
        "checkpoint": os.path.relpath(args.checkpoint),
        "seq_len": args.seq_len,
        "gen_tokens": args.gen_tokens,
        "seconds": time.time() - t0,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(render(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
