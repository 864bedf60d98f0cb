"""Decode (M <= 64) GEMMs at memory speed: FP8 dense layers, the FP8 shared expert and the
MXFP4 routed experts at the bench preset's shapes, per launch configuration.

    python benchmarks/gemm_decode.py --out DIR [--variants new mx_ds ...] [--budget-s S]
                                        [--kinds fp8] [--warm-procs N] [--pick [--verify]]

Cases (M = 1, 8, 64 tokens), built with bench/kernel_roofline.py's helpers:
    fp8_dense          wq_a, wq_b, wkv, wo_a (block-diagonal, as the GPU forward), wo_b,
                       idx_wq_b through `linear_weights` / `block_diagonal`
    fp8_shared_expert  SwiGLU GEMM + down GEMM (`dense_experts`)
    mxfp4_experts      the two routed grouped GEMMs alone, pairs sorted by torch outside the
                       timed region (kernel_roofline's case: comparable to roofline.md)
    routed_full        `moe.triton.routed_experts` as served: pair sorting, both GEMMs, combine
    routed_torch_glue  the same GEMMs with the previous torch glue (argsort chain + per-slot
                       gathers), to price the glue
Times: median per call over CUDA-graph replays (kernel_roofline.graph_ms; weight copies or
alternating routings so weights stream from HBM). Bytes: weights + scales of the experts the
routing touches, activations in and out. Each variant is a dict of DenseConfig overrides
("mx" / "skinny" merged into the defaults); each case's error is against a torch reference on
the dequantised weights. Writes gemm_decode.json and gemm_decode.md under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from flashpd.bench import kernel_roofline as kr
from flashpd.kernels import configs
from flashpd.kernels.configs import KernelConfigs

# name -> (DenseConfig overrides, case kinds it runs, its M values), in priority order (a
# --budget-s run stops starting variants once the budget is spent): "mx" routed experts,
# "fp8" dense layers + shared expert; "new" (the defaults) also runs the comparison cases
_MS = (1, 64)
_WIDE_PF = {"wide": True, "stages": 1, "prefetch": True}
VARIANTS = {
    "new": ({}, ("mx", "fp8"), None),
    "mx_asm_wide": ({"mxfp4_decode": "asm", "mx": {**_WIDE_PF, "block_k": 256}}, ("mx",), _MS),
    "f8_wide": ({"skinny": {**_WIDE_PF, "block_k": 128}}, ("fp8",), _MS),
    "mx_rows384": ({"mx": {"max_rows": 384}}, ("mx",), (64,)),
    "mx_asm_sub": ({"mxfp4_decode": "asm"}, ("mx",), _MS),
    "mx_ds_k256": ({"mx": {"block_k": 256}}, ("mx",), _MS),
    "f8_k128": ({"skinny": {"block_k": 128}}, ("fp8",), _MS),
    "f8_wide_s3": ({"skinny": {"wide": True, "block_k": 128, "stages": 3}}, ("fp8",), _MS),
    "mx_asm_wide_s3": ({"mxfp4_decode": "asm", "mx": {"wide": True, "stages": 3}}, ("mx",), _MS),
    "mx_ds_bn64": ({"mx": {"block_n": 64}}, ("mx",), _MS),
    "f8_t528": ({"skinny": {"target_ctas": 528}}, ("fp8",), _MS),
    "mx_bits_wide": ({"mxfp4_decode": "bits", "mx": {**_WIDE_PF, "block_k": 256}}, ("mx",), _MS),
}
# FP8 dense layers + shared expert (kernels/dense/triton.py CONFIG["skinny"]; every M): deq =
# BF16x2 scale multiply; o16: the "m64" overrides for 64-row tiles, M = 64 here (the key was
# "over16" in the runs of bench/results/h200/dense_fp8.md; a variant without them runs none,
# as then, not the m64 default; "head" = the defaults before it) (r4 = red_unroll 4, the split-K
# reduction 4 partials at a time; w8 = 8 warps; bn = block_n); swap = acc^T += W . A^T (wgmma,
# W in registers); bn / s / t = block_n / stages / target_ctas; pdl = programmatic dependent
# launch with an L2 prefetch of each program's first weight lines. Risky (pdl) and the
# offline-worst (o16r4w8: twice the K-loop instructions per byte, bench/dense_fp8_sass.py) last.
_D = {"deq": "bf16"}
_O = {"m64": {"red_unroll": 4}}
_ALL = (1, 8, 64)
for _name, _tiles in (
    ("f8_deq", _D),
    ("f8_deq_o16r4", {**_D, **_O}),
    ("f8_deq_swap_o16r4", {**_D, **_O, "swap": True}),
    ("f8_deq_bn128_o16r4", {**_D, **_O, "block_n": 128}),
    ("f8_deq_swap_bn128_o16r4", {**_D, **_O, "swap": True, "block_n": 128}),
    (
        "f8_deq_swap_bn256_r4_o16bn128",
        {
            **_D,
            "swap": True,
            "block_n": 256,
            "red_unroll": 4,
            "fit_block_n": True,
            "m64": {"block_n": 128, "swap": False},
        },
    ),
    ("f8_deq_bn256_r4_o16bn128", {**_D, "block_n": 256, "red_unroll": 4, "fit_block_n": True, "m64": {"block_n": 128}}),
    (
        "f8_deq_swap_bn128_r4_o16noswap",
        {**_D, "swap": True, "block_n": 128, "red_unroll": 4, "fit_block_n": True, "m64": {"swap": False}},
    ),
    ("f8_deq_s6_o16r4", {**_D, **_O, "stages": 6}),
    ("f8_deq_t528_o16r4", {**_D, **_O, "target_ctas": 528}),
    ("f8_deq_t132_o16r4", {**_D, **_O, "target_ctas": 132}),
    ("f8_deq_pdl_o16r4", {**_D, **_O, "pdl": True}),
    ("f8_deq_swap_bn128_pdl_o16r4", {**_D, **_O, "swap": True, "block_n": 128, "pdl": True}),
    ("f8_deq_o16r4w8", {**_D, "m64": {"red_unroll": 4, "warps": 8}}),
    # confirmation run: the first run's best split (M <= 16 as f8_deq, M = 64 as
    # f8_deq_swap_o16r4) and its neighbours, with new and the candidate timed twice
    ("f8_deq_o16r4swap", {**_D, "m64": {"red_unroll": 4, "swap": True}}),
    ("f8_deq_o16r8swap", {**_D, "m64": {"red_unroll": 8, "swap": True}}),
    ("f8_deq_o16swap", {**_D, "m64": {"swap": True}}),
    ("f8_o16r4swap", {"m64": {"red_unroll": 4, "swap": True}}),
    ("f8_deq_o16r4swap_again", {**_D, "m64": {"red_unroll": 4, "swap": True}}),
):
    VARIANTS[_name] = ({"skinny": {"m64": {}, **_tiles}}, ("fp8",), _ALL)
VARIANTS["head"] = ({"skinny": {"m64": {}}}, ("fp8",), None)  # before the m64 default
# FP8 swapped-operand kernel at M <= 8 (kernels/dense/fp8_swap.py, bench/results/h200/
# dense_fp8_swap.md): "fp8_swap" = its CONFIG overrides, the path on for every FP8 layer
# (FP8_SWAP_MAX_ROWS = 8); "f8_base" = the split-K tiles alone (the path off). sw = BN 64, K
# step 128, 4 warps, 3 stages, target 264 programs, "asm" decode; then one knob each.
_SW = {"layers": None, "shapes": {}}
VARIANTS["f8_base"] = ({"fp8_swap_max_rows": 0}, ("fp8",), (1, 8))
for _name, _sw in (
    ("sw", {}),
    ("sw_f32", {"deq": "f32"}),
    ("sw_asm1", {"deq": "asm1"}),
    ("sw_bn128", {"block_n": 128}),
    ("sw_k256", {"block_k": 256}),
    ("sw_s4", {"stages": 4}),
    ("sw_k256_s4", {"block_k": 256, "stages": 4}),
    ("sw_bn128_w8", {"block_n": 128, "warps": 8}),
    ("sw_split1", {"max_split": 1}),
    ("sw_split2", {"max_split": 2}),
    ("sw_split4", {"max_split": 4}),
    ("sw_t528", {"target_ctas": 528}),
    ("sw_t132", {"target_ctas": 132}),
    ("sw_bn32_w2", {"block_n": 32, "warps": 2}),
    ("sw_again", {}),
    # second run: next to the committed default (sw_default: fp8_swap.CONFIG as is, its
    # per-shape overrides included)
    ("sw_bn128_w8_t528", {"block_n": 128, "warps": 8, "target_ctas": 528}),
    ("sw_t528_k256", {"target_ctas": 528, "block_k": 256}),
    ("sw_s2", {"stages": 2}),
    ("sw_bn128_w8_s4", {"block_n": 128, "warps": 8, "stages": 4}),
    ("sw_bn128_w8_k256", {"block_n": 128, "warps": 8, "block_k": 256}),
    ("sw_t396", {"target_ctas": 396}),
):
    VARIANTS[_name] = ({"fp8_swap": {**_SW, **_sw}}, ("fp8",), (1, 8))
for _name, _sw in (("sw_default", {}), ("sw_default_asm1", {"deq": "asm1"}), ("sw_default_again", {})):
    VARIANTS[_name] = ({"fp8_swap": _sw}, ("fp8",), (1, 8))
VARIANTS["f8_base_again"] = ({"fp8_swap_max_rows": 0}, ("fp8",), (1, 8))
VARIANTS["new_again"] = ({}, ("fp8",), None)  # the defaults again (run-to-run spread)
# fp8_swap row classes 16 / 32 / 64 at M = 16, 32, 64 (bench/results/h200/dense_fp8_rows.md):
# "rows_base" = the defaults as committed (the path at <= FP8_SWAP_MAX_ROWS rows, split-K tiles
# above); r_* = the path on to 64 rows with fp8_swap.CONFIG["classes"] 16 / 32 / 64 as named:
# wN = warps, bnN = block_n (w2: 32, w4: 64, w8: 128 unless named), half = each class as two
# row blocks of half its width (rows 8 / 16 / 32), tN = target_ctas, kN = block_k, sN = stages.
_ROWS_M = (16, 32, 64)


def _classes(bn: int, warps: int, half: bool = False, **extra) -> dict:
    return {
        8: {"rows": 8},
        **{c: {"rows": c // 2 if half else c, "block_n": bn, "warps": warps, "shapes": {}, **extra} for c in _ROWS_M},
    }


for _name, _cl in (
    ("r_w4", _classes(64, 4)),
    ("r_w2", _classes(32, 2)),
    ("r_half_w2", _classes(32, 2, half=True)),
    ("r_w8", _classes(128, 8)),
    ("r_half_w4", _classes(64, 4, half=True)),
    ("r_bn64w2", {**_classes(64, 2), 64: {"rows": 32, "block_n": 64, "warps": 2, "shapes": {}}}),
    ("r_w2_t528", _classes(32, 2, target_ctas=528)),
    ("r_w4_t528", _classes(64, 4, target_ctas=528)),
    ("r_w2_t132", _classes(32, 2, target_ctas=132)),
    ("r_w4_t132", _classes(64, 4, target_ctas=132)),
    ("r_w2_k64", _classes(32, 2, block_k=64)),
    ("r_w4_k64", _classes(64, 4, block_k=64)),
    ("r_w2_s4", _classes(32, 2, stages=4)),
    ("r_half_w2_t528", _classes(32, 2, half=True, target_ctas=528)),
    ("r_w2_again", _classes(32, 2)),
    ("r_w4_again", _classes(64, 4)),
):
    VARIANTS[_name] = ({"fp8_swap": {"classes": _cl}}, ("fp8",), _ROWS_M)
VARIANTS["rows_base"] = ({}, ("fp8",), _ROWS_M)
VARIANTS["rows_base_again"] = ({}, ("fp8",), _ROWS_M)
_NEW_ONLY = ("mxfp4_experts", "routed_torch_glue", "moe_full")


def variant_configs(overrides: dict) -> KernelConfigs:
    """The default kernel configs + a variant's DenseConfig overrides ("mx" / "skinny" merged);
    "fp8_swap": Fp8SwapConfig fields replaced, with the path on to its widest row class;
    "fp8_swap_max_rows": the dense bound alone."""
    from flashpd.kernels.dense import fp8_swap as fs

    over = dict(overrides)
    swap = over.pop("fp8_swap", None)
    tuned = configs.merge(configs.DEFAULT, dense=over)
    if swap is not None:
        tuned = configs.override(tuned, dense={"fp8_swap": swap})
        tuned = configs.override(tuned, dense={"fp8_swap_max_rows": fs.max_rows(tuned.dense.fp8_swap)})
    return tuned


def apply(overrides: dict) -> None:
    """The cases' kernel calls run with this variant's configs from now on (kr.LAUNCH)."""
    kr.LAUNCH.tuned = variant_configs(overrides)


def routed_cases(ms) -> list:
    """routed_full and routed_torch_glue at each M (two routings alternate)."""
    from flashpd.kernels.dense import triton as dt
    from flashpd.kernels.moe import ref as mref
    from flashpd.kernels.moe import triton as mt

    e_, k_, d_, i_ = kr.EXPERTS, kr.TOP_K, kr.HIDDEN, kr.INTER
    routed = mt.ExpertSet(kr.rand_mxfp4(i_, d_, e_, 11), kr.rand_mxfp4(i_, d_, e_, 12), kr.rand_mxfp4(d_, i_, e_, 13))
    per_expert = sum(kr.wbytes(w) for w in (routed.w1, routed.w3, routed.w2)) / e_
    deq = [None] * 3
    g = torch.Generator().manual_seed(17)
    out = []
    for m in ms:
        sets = []
        for _ in range(2):
            ids = torch.stack([torch.randperm(e_, generator=g)[:k_] for _ in range(m)]).to(kr.DEV)
            sets.append((ids, (torch.rand(m, k_, generator=g) * 0.3).to(kr.DEV)))
        x = torch.randn(m, d_, device=kr.DEV).to(torch.bfloat16)
        distinct = statistics.mean(len(torch.unique(ids)) for ids, _ in sets)
        nbytes = distinct * per_expert + m * d_ * (2 + 4) + m * k_ * (i_ * 2 * 2 + d_ * 2)

        def glue(ids, gam, x=x, m=m):  # the previous routed_experts (torch glue), same GEMMs
            flat = ids.reshape(-1)
            order = torch.argsort(flat, stable=True)
            rows = (order // k_).to(torch.int32)
            gamma = gam.reshape(-1)[order].to(torch.float32).contiguous()
            counts = torch.zeros(e_, dtype=torch.int64, device=x.device)
            counts.scatter_add_(0, flat, torch.ones_like(flat))
            dense = kr.LAUNCH.tuned.dense
            sched = dt.grouped_schedule(counts, m * k_, dt.block_m_for(max(1, m * k_ // e_), dense))
            h = torch.empty(m * k_, i_, dtype=x.dtype, device=x.device)
            dt.grouped_gemm(x, routed.w1, sched, h, a_rows=rows, w3=routed.w3, gamma=gamma, limit=10.0, cfg=dense)
            y = torch.empty(m * k_, d_, dtype=x.dtype, device=x.device)
            dt.grouped_gemm(h, routed.w2, sched, y, cfg=dense)
            position = torch.empty_like(order)
            position[order] = torch.arange(m * k_, device=x.device)
            position = position.reshape(m, k_).sort(dim=-1).values
            acc = torch.zeros(m, d_, dtype=torch.float32, device=x.device)
            for slot in range(k_):
                acc = acc + y[position[:, slot]].to(torch.float32)
            return acc

        def check(fn, ids=sets[0][0], gam=sets[0][1], x=x):
            if deq[0] is None:
                deq[:] = [torch.stack([kr.deq_one(w, j) for j in range(e_)]) for w in (routed.w1, routed.w3, routed.w2)]
            want = torch.zeros(x.shape[0], d_, dtype=torch.float32, device=kr.DEV)
            for j in torch.unique(ids).tolist():
                tok, slot = torch.nonzero(ids == j, as_tuple=True)
                y = mref.expert_ffn(x[tok], deq[0][j], deq[1][j], deq[2][j], 10.0, gam[tok, slot][:, None])
                want.index_add_(0, tok, y.float())
            return kr.rel_err(fn(ids, gam), want)

        for name, fn in (
            ("routed_full", lambda i, w, x=x: mt.routed_experts(x, i, w, routed, 10.0, tuned=kr.LAUNCH.tuned)),
            ("routed_torch_glue", glue),
        ):
            c = kr.Case(name, f"routed E={e_} k={k_} I={i_}", m, "decode")
            c.bytes, c.flops = nbytes, 6.0 * m * k_ * d_ * i_
            c.calls = [lambda s=s, fn=fn: fn(*s) for s in sets]
            c.check = lambda fn=fn, check=check: check(fn)
            out.append(c)
        out.append(_moe_full(x, routed, per_expert))
    return out


def _moe_full(x: torch.Tensor, routed, per_expert: float):
    """The whole decode MoE layer as served: router, pair sort, routed GEMMs, shared expert,
    combine (checked against routed_experts + dense_experts on the router's own choice)."""
    from flashpd.kernels.moe import triton as mt

    e_, k_, d_, i_ = kr.EXPERTS, kr.TOP_K, kr.HIDDEN, kr.INTER
    gate = (torch.randn(e_, d_, device=kr.DEV) * d_**-0.5).to(torch.bfloat16)
    bias = torch.zeros(e_, device=kr.DEV)
    shared = mt.ExpertSet(kr.rand_fp8(i_, d_, seed=21), kr.rand_fp8(i_, d_, seed=22), kr.rand_fp8(d_, i_, seed=23))
    ids, _ = mt.route(x, gate, bias, k_, 1.0)
    c = kr.Case("moe_full", f"router+routed+shared E={e_} k={k_}", x.shape[0], "decode")
    c.bytes = (
        len(torch.unique(ids)) * per_expert
        + gate.numel() * 2
        + x.numel() * 4
        + sum(kr.wbytes(w) for w in (shared.w1, shared.w3, shared.w2))
    )
    c.flops = 6.0 * x.shape[0] * (k_ + 1) * d_ * i_
    c.calls = [lambda: mt.moe_quantized(x, gate, bias, routed, shared, k_, 1.0, 10.0, tuned=kr.LAUNCH.tuned)]

    def check():
        i, w = mt.route(x, gate, bias, k_, 1.0)
        tuned = kr.LAUNCH.tuned
        want = (
            mt.routed_experts(x, i, w, routed, 10.0, tuned=tuned)
            + mt.dense_experts(x, shared, 10.0, None, tuned.dense).float()
        ).to(x.dtype)
        return kr.rel_err(mt.moe_quantized(x, gate, bias, routed, shared, k_, 1.0, 10.0, tuned=tuned), want)

    c.check = check
    return c


def stacked_cases(ms) -> list:
    """The layers that share an input as one GEMM each (`Weights.stack_out`): wq_a + wkv (both
    on the hidden state) and wq_b + idx_wq_b (both on c_q); weight copies rotate as in
    kernel_roofline.dense_cases."""
    from flashpd.kernels.dense import triton as dt

    hid, q_lora = kr.HIDDEN, kr.Q_LORA
    pairs = {
        "wq_a+wkv": ((kr.Q_LORA, hid), (kr.HEAD_DIM, hid)),
        "wq_b+idx_wq_b": ((kr.HEADS * kr.HEAD_DIM, q_lora), (kr.INDEX_HEADS * kr.INDEX_DIM, q_lora)),
    }
    out = []
    for i, (name, shapes) in enumerate(pairs.items()):
        base = dt.Weights.stack_out([kr.rand_fp8(n, k, seed=31 + 2 * i + j) for j, (n, k) in enumerate(shapes)])
        copies = [base] + [
            dt.Weights(base.fmt, base.data.clone(), base.scale.clone())
            for _ in range(kr.copies_for(kr.wbytes(base)) - 1)
        ]
        ref_w = kr.deq(base)[0]
        n, k = base.out_dim, base.in_dim
        for m in ms:
            c = kr.Case("fp8_stacked", f"{name} N={n} K={k}", m, "decode")
            x = torch.randn(m, k, device=kr.DEV).to(torch.bfloat16)
            c.bytes, c.flops = kr.wbytes(base) + m * (k + n) * 2, 2.0 * m * n * k
            c.calls = [lambda w=w, x=x: dt.linear_weights(x, w, torch.bfloat16, tuned=kr.LAUNCH.tuned) for w in copies]
            c.check = lambda x=x, w=base, r=ref_w: kr.rel_err(
                dt.linear_weights(x, w, torch.bfloat16, tuned=kr.LAUNCH.tuned), x.float() @ r.T
            )
            out.append(c)
    return out


def build_cases(ms, kinds=("mx", "fp8"), layers=None) -> dict[str, list]:
    """Cases by kind at each M; layers: only the FP8 cases of these names (shape's first word:
    wq_a, wq_b+idx_wq_b, shared, ...), None: all."""
    experts = kr.expert_cases(ms)
    out = {"fp8": [], "mx": []}
    if "fp8" in kinds:
        dense = [
            c
            for c in kr.dense_cases(ms, ["wq_a", "wq_b", "wkv", "wo_a", "wo_b", "idx_wq_b"])
            if " G=" not in c.shape or "block_diagonal" in c.shape
        ]
        out["fp8"] = dense + [c for c in experts if c.kernel == "fp8_shared_expert"] + stacked_cases(ms)
        if layers:
            out["fp8"] = [c for c in out["fp8"] if c.shape.split(" ")[0] in layers]
    if "mx" in kinds:
        out["mx"] = [c for c in experts if c.kernel == "mxfp4_experts"] + routed_cases(ms)
    return out


def _selected(v: str, cases: dict, kinds) -> list:
    """The cases variant v runs: its kinds (of those asked for) at its M values."""
    _over, vkinds, ms = VARIANTS[v]
    return [
        c
        for kind in vkinds
        if kind in kinds
        for c in cases[kind]
        if (ms is None or c.m in ms) and (v == "new" or c.kernel not in _NEW_ONLY)
    ]


def warm(variants, kinds, layers=None) -> None:
    """Compile (one call of each case) every variant's kernels: fills Triton's disk cache."""
    cases = build_cases(kr.DECODE_M, kinds, layers)
    for v in variants:
        apply(VARIANTS[v][0])
        for c in _selected(v, cases, kinds):
            try:
                c.calls[0]()
            except Exception as exc:  # the timing run reports it
                print(f"warm {v} {c.shape} M={c.m}: {type(exc).__name__}", flush=True)
        if kr.DEV == "cuda":
            torch.cuda.synchronize()
        print(f"warm {v} done", flush=True)


def warm_parallel(variants, kinds, procs: int, smoke: bool, ms=None, layers=None) -> list:
    """Start warm() in `procs` subprocesses (variants dealt round-robin), so the compiles of
    many variants overlap; the timing run then loads every kernel from the disk cache."""
    import subprocess
    import sys

    groups = [variants[i::procs] for i in range(procs) if variants[i::procs]]
    extra = ["--smoke"] if smoke else []
    extra += ["--ms", *map(str, ms)] if ms else []
    extra += ["--layers", *layers] if layers else []
    return [
        subprocess.Popen([sys.executable, __file__, "--warm-only", *extra, "--kinds", *kinds, "--variants", *g])
        for g in groups
    ]


def wait_all(jobs: list, timeout_s: float) -> None:
    import subprocess

    deadline = time.perf_counter() + timeout_s
    for j in jobs:
        try:
            j.wait(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            j.kill()
            print("warm: a worker ran past its time; its variants compile in the timing run", flush=True)


def kernel_facts(seen: set) -> dict:
    """Registers, spills, shared memory and MMA form of the split-K kernel's and the FP8 swap
    kernel's binaries loaded since the last call (keys in `seen` are skipped and then added)."""
    import re

    from flashpd.kernels.dense import fp8_swap as fs
    from flashpd.kernels.dense import triton as dt

    facts = []
    binaries = [
        (("splitk", key), k) for dev_cache in dt.SPLITK_KERNEL.device_caches.values() for key, k in dev_cache[0].items()
    ]
    binaries += [(("fp8_swap", id(k)), k) for k in fs.compiled_variants()]
    for key, k in binaries:
        if key in seen:
            continue
        seen.add(key)
        ptx = k.asm.get("ptx", "")
        mma = sorted(
            set(
                re.findall(
                    r"(wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+|"
                    r"mma\.sync\.aligned\.m\d+n\d+k\d+)",
                    ptx,
                )
            )
        )
        facts.append(
            {
                "kernel": key[0],
                "regs": getattr(k, "n_regs", None),
                "spills": getattr(k, "n_spills", None),
                "smem": k.metadata.shared,
                "warps": k.metadata.num_warps,
                "mma": mma,
            }
        )
    return {
        "kernels": len(facts),
        "max_regs": max((f["regs"] or 0 for f in facts), default=0),
        "max_spills": max((f["spills"] or 0 for f in facts), default=0),
        "mma": sorted({m for f in facts for m in f["mma"]}),
        "each": facts,
    }


def swap_table(rows: list[dict]) -> str:
    """Per layer and M: f8_base us vs every fp8_swap variant's, the fastest named (markdown)."""
    ok = [
        r
        for r in rows
        if "ms" in r and r["M"] <= 8 and r["kernel"] in ("fp8_dense", "fp8_shared_expert", "fp8_stacked")
    ]
    sw = list(dict.fromkeys(r["variant"] for r in ok if r["variant"].startswith("sw")))
    by = {(r["variant"], r["shape"].split(" ")[0], r["M"]): r for r in ok}
    keys = list(dict.fromkeys((r["shape"].split(" ")[0], r["M"]) for r in ok))
    lines = [
        "| layer | M | MB | f8_base us | " + " | ".join(sw) + " | best | best GB/s (% copy) | err |",
        "|---|---|---|---|" + "---|" * (len(sw) + 3),
    ]
    for layer, m in keys:
        base = by.get(("f8_base", layer, m))
        cells = [by.get((v, layer, m)) for v in sw]
        timed = [(c["ms"], v) for c, v in zip(cells, sw, strict=True) if c]
        best = min(timed) if timed else None
        br = by.get((best[1], layer, m)) if best else None
        lines.append(
            f"| {layer} | {m} | {(base or br or {}).get('bytes', 0) / 1e6:.1f} | "
            + (f"{base['ms'] * 1e3:.1f}" if base else "-")
            + " | "
            + " | ".join(f"{c['ms'] * 1e3:.1f}" if c else "-" for c in cells)
            + (
                f" | {best[1]} {best[0] * 1e3:.1f} | {br['GBps']:.0f} ({br['pct_copy']:.0f}%) | {br['rel_err']:.1e} |"
                if br
                else " | - | - | - |"
            )
        )
    return "\n".join(lines) + "\n"


def run(variant: str, cases: list, ceilings: dict) -> list[dict]:
    rows = []
    for c in cases:
        row = {"variant": variant, "kernel": c.kernel, "shape": c.shape, "M": c.m, "bytes": c.bytes, "flops": c.flops}
        try:
            row["rel_err"] = c.check()
            row["ms"] = kr.graph_ms(c.calls)
        except Exception as exc:  # one bad configuration must not lose the rest
            row["error"] = f"{type(exc).__name__}: {exc}"[-800:]
            print(f"{variant:>12} {c.kernel:<18} {c.shape:<34} M={c.m:<3} FAILED {row['error']}", flush=True)
            rows.append(row)
            continue
        row["GBps"] = c.bytes / (row["ms"] * 1e-3) / 1e9
        row["pct_copy"] = 100 * row["GBps"] / ceilings["copy_GBps"]
        rows.append(row)
        print(
            f"{variant:>12} {c.kernel:<18} {c.shape:<34} M={c.m:<3} {row['ms'] * 1e3:8.1f} us "
            f"{row['GBps']:6.0f} GB/s {row['pct_copy']:5.1f}% err {row['rel_err']:.1e}",
            flush=True,
        )
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    ok = [r for r in rows if "ms" in r]
    variants = list(dict.fromkeys(r["variant"] for r in ok))
    keys = list(dict.fromkeys((r["kernel"], r["shape"], r["M"]) for r in ok))
    by = {(r["variant"], r["kernel"], r["shape"], r["M"]): r for r in ok}
    lines = [
        f"Generated by `{meta['command']}` on {meta['device']} (torch {meta['torch']}, "
        f"triton {meta['triton']}); copy ceiling {meta['copy_GBps']:.0f} GB/s.",
        "",
        "| kernel | shape | M | MB | " + " | ".join(f"{v} us (% copy)" for v in variants) + " | err |",
        "|---|---|---|---|" + "---|" * (len(variants) + 1),
    ]
    for k in keys:
        cells = []
        for v in variants:
            r = by.get((v,) + k)
            cells.append(f"{r['ms'] * 1e3:.1f} ({r['pct_copy']:.0f}%)" if r else "-")
        present = [by[(v,) + k] for v in variants if (v,) + k in by]
        lines.append(
            f"| {k[0]} | {k[1]} | {k[2]} | {present[0]['bytes'] / 1e6:.1f} | "
            + " | ".join(cells)
            + f" | {max(r['rel_err'] for r in present):.1e} |"
        )
    for stacked in (False, True, "engine"):
        sums = _fp8_layer_sums(ok, stacked)
        if not sums:
            continue
        ms = sorted({m for _v, m in sums})
        what = {
            False: "6 dense layers + shared expert",
            True: "wq_a+wkv and wq_b+idx_wq_b stacked (Weights.stack_out), wo_a, wo_b, shared",
            "engine": "as the engine runs them: wq_a+wkv stacked, wq_b, wo_a, wo_b, idx_wq_b, shared",
        }[stacked]
        lines += [
            "",
            f"Per-layer FP8 sum ({what}; us, and M / M=1):",
            "",
            "| variant | " + " | ".join(f"M={m}" for m in ms) + " |",
            "|---|" + "---|" * len(ms),
        ]
        for v in dict.fromkeys(v for v, _m in sums):
            base = sums.get((v, 1))
            lines.append(
                f"| {v} | "
                + " | ".join(
                    (f"{sums[(v, m)]:.1f}" + (f" ({sums[(v, m)] / base:.2f}x)" if base else ""))
                    if (v, m) in sums
                    else "-"
                    for m in ms
                )
                + " |"
            )
    failed = [r for r in rows if "error" in r]
    if failed:
        lines += ["", "Failed:"] + [
            f"- {r['variant']} {r['kernel']} {r['shape']} M={r['M']}: {r['error'][:300]}" for r in failed
        ]
    return "\n".join(lines) + "\n"


def _fp8_layer_sums(ok: list[dict], stacked: bool | str = False) -> dict:
    """(variant, M) -> us of one layer's FP8 GEMMs, where all seven were timed; stacked: with
    wq_a + wkv and wq_b + idx_wq_b as their two stacked GEMMs instead (where timed); "engine":
    wq_a + wkv stacked, the rest as single GEMMs (the GPU forward since commit 7882d34)."""
    per: dict = {}
    for r in ok:
        if r["kernel"] in ("fp8_dense", "fp8_shared_expert", "fp8_stacked"):
            per.setdefault((r["variant"], r["M"]), {})[r["shape"].split(" ")[0]] = r["ms"] * 1e3
    out = {}
    for key, t in per.items():
        layers = ["wq_a", "wq_b", "wkv", "wo_a", "wo_b", "idx_wq_b", "shared"]
        if stacked == "engine":
            layers = ["wq_a+wkv", "wq_b", "wo_a", "wo_b", "idx_wq_b", "shared"]
        elif stacked:
            layers = ["wq_a+wkv", "wq_b+idx_wq_b", "wo_a", "wo_b", "shared"]
        if all(name in t for name in layers):
            out[key] = sum(t[name] for name in layers)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/h200")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--kinds", nargs="*", default=["mx", "fp8"])
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no variant after this many seconds")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes under the interpreter")
    ap.add_argument(
        "--pick", action="store_true", help="then time the fastest variants' merged overrides on every case"
    )
    ap.add_argument(
        "--verify", action="store_true", help="with --pick: then verify-kernels gemm + moe_gate under that config"
    )
    ap.add_argument(
        "--warm-procs", type=int, default=0, help="compile the variants first in this many parallel processes"
    )
    ap.add_argument("--warm-timeout-s", type=float, default=150.0)
    ap.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--ms", nargs="*", type=int, default=None, help="the M values of the cases (default kernel_roofline.DECODE_M)"
    )
    ap.add_argument(
        "--layers",
        nargs="*",
        default=None,
        help="only these FP8 cases (wq_a+wkv, wq_b, wo_a, wo_b, idx_wq_b, shared ...)",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        kr.use_tiny_shapes()
    elif not torch.cuda.is_available():
        raise SystemExit("gemm_decode needs a CUDA GPU (or --smoke)")
    import triton

    default = configs.DEFAULT.dense.as_dict()
    if args.ms:
        kr.DECODE_M = tuple(args.ms)
    if args.warm_only:
        warm(args.variants, args.kinds, args.layers)
        return 0
    t_start = time.perf_counter()
    jobs = (
        warm_parallel(args.variants, args.kinds, args.warm_procs, args.smoke, args.ms, args.layers)
        if args.warm_procs > 0
        else []
    )
    ceilings = kr.measure_ceilings() if kr.DEV == "cuda" else {"copy_GBps": 1.0}
    meta = {
        "command": "python benchmarks/gemm_decode.py " + " ".join(argv or []),
        "device": torch.cuda.get_device_name() if kr.DEV == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_GBps": ceilings["copy_GBps"],
        "dense_config": default,
    }
    print(f"copy ceiling {ceilings['copy_GBps']:.0f} GB/s", flush=True)
    cases = build_cases(kr.DECODE_M, args.kinds, args.layers)
    os.makedirs(args.out, exist_ok=True)
    if jobs:
        wait_all(jobs, args.warm_timeout_s - (time.perf_counter() - t_start))
        print(f"warm: {time.perf_counter() - t_start:.0f}s", flush=True)
    rows: list[dict] = []
    t0 = t_start
    seen: set = set()
    meta["kernels"] = {}
    for v in args.variants:
        if time.perf_counter() - t0 > args.budget_s:
            print(f"budget spent: {v} and later variants not run", flush=True)
            break
        apply(VARIANTS[v][0])
        rows += run(v, _selected(v, cases, args.kinds), ceilings)
        apply({})
        if kr.DEV == "cuda":
            try:
                facts = meta["kernels"][v] = kernel_facts(seen)
                print(
                    f"-- {v}: {facts['kernels']} new binaries, max regs {facts['max_regs']}, "
                    f"max spills {facts['max_spills']}, {facts['mma']}",
                    flush=True,
                )
            except Exception as exc:  # facts are a by-product: never lose the timings
                print(f"-- {v}: kernel facts unavailable ({type(exc).__name__}: {exc})")
        with open(os.path.join(args.out, "gemm_decode.json"), "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
        with open(os.path.join(args.out, "gemm_decode.md"), "w") as f:
            f.write(markdown(meta, rows))
        print(f"-- {v} done at {time.perf_counter() - t0:.0f}s", flush=True)
    print(markdown(meta, rows))
    if any(r["variant"].startswith("sw") for r in rows):
        table = swap_table(rows)
        print(table)
        with open(os.path.join(args.out, "gemm_decode_swap.md"), "w") as f:
            f.write(table)
    if args.pick:
        best = pick(rows)
        print("best overrides:", json.dumps(best), flush=True)
        with open(os.path.join(args.out, "gemm_decode_best.json"), "w") as f:
            json.dump(best, f)
        if best:
            apply(best)
            rows += run("best", [c for kind in args.kinds for c in cases[kind] if c.kernel not in _NEW_ONLY], ceilings)
            with open(os.path.join(args.out, "gemm_decode.md"), "w") as f:
                f.write(markdown(meta, rows))
            with open(os.path.join(args.out, "gemm_decode.json"), "w") as f:
                json.dump({"meta": meta, "results": rows, "best": best}, f, indent=1)
            print(markdown(meta, rows))
        if args.verify:
            from flashpd.kernels import verify

            results = verify.run_checks("bench", ["gemm", "moe_gate"], timing=False)
            print(verify.format_table(results))
            failed = [r for r in results if not r.passed]
            print(
                f"verify-kernels (config {json.dumps(best)}): {len(results) - len(failed)} "
                f"passed, {len(failed)} failed",
                flush=True,
            )
    return 0


def pick(rows: list[dict]) -> dict:
    """Merged overrides of the fastest MXFP4 and the fastest FP8 variant: score = mean over
    their timed cases of ms / the defaults' ms (errors, or err >= 1e-2, disqualify)."""
    ok = {(r["variant"], r["kernel"], r["shape"], r["M"]): r for r in rows if "ms" in r}
    best: dict = {}
    for kind in ("mx", "fp8"):
        scores = {}
        for v, (_over, kinds, _ms) in VARIANTS.items():
            mine = [
                r
                for r in rows
                if r["variant"] == v
                and kind in kinds
                and (r["kernel"].startswith(("routed", "mxfp4")) == (kind == "mx"))
            ]
            if v == "new" or not mine:
                continue
            if any("error" in r or r["rel_err"] >= 1e-2 for r in mine):
                continue
            ratios = [
                r["ms"] / ok[("new", r["kernel"], r["shape"], r["M"])]["ms"]
                for r in mine
                if ("new", r["kernel"], r["shape"], r["M"]) in ok
            ]
            if ratios:
                scores[v] = statistics.mean(ratios)
        if scores and min(scores.values()) < 0.97:
            v = min(scores, key=scores.get)
            print(f"{kind}: best {v} ({scores[v]:.3f} of the defaults' time); scores {scores}")
            for k, val in VARIANTS[v][0].items():
                best[k] = {**best.get(k, {}), **val} if isinstance(val, dict) else val
    return best


if __name__ == "__main__":
    raise SystemExit(main())
