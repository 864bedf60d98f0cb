"""The cases of kernels/verify.py: per op, inputs at `tiny` and `bench` shapes, kernel vs ref.

Bench shapes follow the bench preset (model_spec §1.1 per-layer geometry): hidden 5120, 64 heads
x 512, window 128, top-k 512, index 32 x 128, 64 routed experts (384 for the router, as
released), d_ff 2304, mHC S = 4, Engram rows of 256 with 24 columns.
"""

from __future__ import annotations

import torch

from flashpd.kernels import dispatch
from flashpd.kernels.configs import DEFAULT, KernelConfigs
from flashpd.kernels.verify import (
    Check,
    _timed,
    close_check,
    device,
    exact_check,
    randn,
    register_check,
    selection_check,
)


def _dims(scale: str, tiny: dict, bench: dict) -> dict:
    return tiny if scale == "tiny" else bench


def _rope(num: int, pairs: int, seed: int):
    from flashpd.kernels.rope import ref as rope

    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 1 << 20, (num,), generator=g)
    freqs = rope.rope_frequencies(2 * pairs, 160000.0, rope.Yarn(16, 32, 1, 65536))
    cos, sin = rope.rope_cos_sin(pos, freqs)
    return pos.to(device()), freqs.to(device()), (cos.to(device()), sin.to(device()))


# ============================================================================ 1. KV writes
@register_check("kv_write")
def check_kv_write(scale: str, timing: bool, *, tuned: KernelConfigs = DEFAULT) -> list[Check]:
    from flashpd.kernels.quant import ref as qref
    from flashpd.kernels.quant import triton as qt

    qt = dispatch.bind(qt, tuned)

    dm = _dims(scale, dict(n=12, d=64, di=32, rp=8), dict(n=8192, d=512, di=128, rp=32))
    return [
        _kv_write_case(name, write, pack, dim, dm["n"], dm["rp"], timing, tuned=tuned)
        for name, write, pack, dim in (
            ("window_fp8", qt.write_window_fp8, qref.pack_window_fp8, dm["d"]),
            ("compressed_nvfp4", qt.write_nvfp4, qref.pack_nvfp4, dm["d"]),
            ("index_mxfp4", qt.write_mxfp4, qref.pack_mxfp4, dm["di"]),
        )
    ]


def _kv_write_case(
    name: str, write, pack, dim: int, n: int, rope_pairs: int, timing: bool, *, tuned: KernelConfigs = DEFAULT
) -> Check:
    from flashpd.kernels.rope import ref as rope

    vals = randn(n, dim, seed=1, scale=3.0)
    pos, freqs, tables = _rope(n, rope_pairs, seed=2)
    rows = torch.randperm(2 * n, generator=torch.Generator().manual_seed(3))[:n].to(device())
    rows[::7] = -1
    pool = torch.full((2 * n, pack(vals[:1]).shape[1]), 0xAB, dtype=torch.uint8, device=device())
    write(vals, rows, pool, rope=tables)
    expect = pack(rope.apply_rope(vals, pos, freqs))
    live = rows >= 0
    chk = exact_check("kv_write", f"{name} +rope N={n} D={dim}", pool[rows[live]], expect[live])
    untouched = torch.ones(2 * n, dtype=torch.bool, device=device())
    untouched[rows[live]] = False
    if not bool((pool[untouched] == 0xAB).all()):
        chk.passed, chk.note = False, "wrote outside the destination rows"
    chk.bytes_moved = n * dim * 2 + n * pool.shape[1] + n * rope_pairs * 8
    return _timed(
        chk, timing, lambda: write(vals, rows, pool, rope=tables), lambda: pack(rope.apply_rope(vals, pos, freqs))
    )


# ============================================================================ 2. MoE gate
@register_check("moe_gate")
def check_moe_gate(scale: str, timing: bool, *, tuned: KernelConfigs = DEFAULT) -> list[Check]:

    shapes = (
        [(20, 128, 8, 2)]
        if scale == "tiny"
        else [(64, 5120, 64, 6), (4096, 5120, 64, 6), (64, 5120, 384, 6), (4096, 5120, 384, 6)]
    )
    return [c for t, d, e, k in shapes for c in _route_case(t, d, e, k, timing, tuned=tuned)]


def _route_case(t: int, d: int, e: int, k: int, timing: bool, *, tuned: KernelConfigs = DEFAULT) -> list[Check]:
    from flashpd.kernels.moe import ref as mref
    from flashpd.kernels.moe import triton as mt

    mt = dispatch.bind(mt, tuned)

    x = randn(t, d, seed=10)
    w = randn(e, d, seed=11, scale=d**-0.5)
    bias = randn(e, seed=12, scale=0.1, dtype=torch.float32)
    ids, gam = mt.route(x, w, bias, k, 1.5)
    rids, rgam = mref.route(x, w, bias, k, 1.5)
    biased = torch.sqrt(mref.softplus(mref.linear_fp32(x, w))) + bias[None]
    sel = selection_check("moe_gate", f"route ids T={t} E={e} k={k}", ids, rids, biased, 1e-5)
    same = torch.equal(ids, rids)  # else compare the weight multisets (near-tie swaps)
    wts = close_check(
        "moe_gate",
        f"route weights T={t} E={e}",
        gam if same else gam.sort(1).values,
        rgam if same else rgam.sort(1).values,
        1e-5,
    )
    sel.flops = 2.0 * t * e * d
    sel.bytes_moved = t * d * 2 + e * d * 2
    _timed(sel, timing, lambda: mt.route(x, w, bias, k, 1.5), lambda: mref.route(x, w, bias, k, 1.5))
    if sel.kernel_ms and sel.ref_ms:
        sel.note += f"; fused {sel.ref_ms / sel.kernel_ms:.2f}x vs unfused torch"
    return [sel, wts]


# ============================================================================ 3. mHC
@register_check("mhc")
def check_mhc(scale: str, timing: bool, *, tuned: KernelConfigs = DEFAULT) -> list[Check]:

    shapes = [(19, 96)] if scale == "tiny" else [(64, 5120), (4096, 5120)]
    return [c for t, d in shapes for c in _mhc_case(t, d, timing, tuned=tuned)]


def _mhc_inputs(t: int, d: int, s: int):
    """x (T, S, D), y (T, D), the mix weights, base and scales, the norm weight."""
    x = randn(t, s, d, seed=20)
    y = randn(t, d, seed=21)
    fn = randn(24, s * d, seed=22, scale=(s * d) ** -0.5, dtype=torch.float32)
    base = randn(24, seed=23, scale=0.5, dtype=torch.float32)
    hsc = torch.tensor([1.0, 0.5, 2.0], device=device())
    nw = randn(d, seed=24)
    return x, y, fn, base, hsc, nw


def _mhc_case(t: int, d: int, timing: bool, *, tuned: KernelConfigs = DEFAULT) -> list[Check]:
    from flashpd.kernels.dense import ref as dref
    from flashpd.kernels.mhc import ref as href
    from flashpd.kernels.mhc import triton as ht

    ht = dispatch.bind(ht, tuned)

    out = []
    s = 4
    x, y, fn, base, hsc, nw = _mhc_inputs(t, d, s)
    pre_in, post, comb = href.hc_mixes(x, fn, base, hsc, 20, 1e-6, 1e-20)

    def unfused():
        xn = href.expand(y, x, post, comb)
        mixes = href.hc_mixes(xn, fn, base, hsc, 20, 1e-6, 1e-20)
        return xn, mixes, dref.rms_norm(href.collapse(xn, pre_in), nw, 1e-20)

    def fused():
        return ht.expand_mix_collapse(y, x, post, comb, fn, base, hsc, 20, 1e-6, 1e-20, pre_in, nw)

    xn, (rpre, rpost, rcomb), rxc = unfused()
    fxn, fpre, fpost, fcomb, fxc = fused()
    main = close_check("mhc", f"fused write-back+mixes+norm T={t}", fxn, xn, 8e-3)
    main.bytes_moved = t * s * d * 2 * 2 + t * d * 2 * 3 + 24 * s * d * 4
    main.flops = 2.0 * t * 24 * s * d
    out.append(_timed(main, timing, fused, unfused))
    if main.kernel_ms and main.ref_ms:
        main.note = f"fused {main.ref_ms / main.kernel_ms:.2f}x vs unfused torch"
    return out + _mhc_part_checks(t, (fpre, fpost, fcomb, fxc), (rpre, rpost, rcomb, rxc))


def _mhc_part_checks(t: int, fused: tuple, ref: tuple) -> list[Check]:
    """The fused kernel's other outputs: pre/post mixes, Sinkhorn comb, collapsed + RMSNorm."""
    fpre, fpost, fcomb, fxc = fused
    rpre, rpost, rcomb, rxc = ref
    return [
        close_check("mhc", f"pre/post T={t}", torch.cat((fpre, fpost), 1), torch.cat((rpre, rpost), 1), 1e-4),
        close_check("mhc", f"comb (Sinkhorn) T={t}", fcomb, rcomb, 1e-4),
        close_check("mhc", f"collapsed+RMSNorm T={t}", fxc, rxc, 2e-2),
    ]


# ============================================================================ 4. indexer
def _index_inputs(t: int, n: int, h: int, di: int, seed: int):
    from flashpd.kernels.quant import ref as qref

    q = qref.fake_quant_mxfp4(randn(t, h, di, seed=seed, dtype=torch.float32)).bfloat16()
    w = randn(t, h, seed=seed + 1, scale=1 / 64, dtype=torch.float32)
    records = qref.pack_mxfp4(randn(n, di, seed=seed + 2, dtype=torch.float32))
    g = torch.Generator().manual_seed(seed + 3)
    n_vis = torch.randint(max(1, n // 2), n + 1, (t,), generator=g)
    n_vis[-1] = n
    return q, w, records, n_vis.to(device())


@register_check("indexer")
def check_indexer(scale: str, timing: bool, *, tuned: KernelConfigs = DEFAULT) -> list[Check]:

    dm = _dims(
        scale,
        dict(t=5, h=4, di=32, k=16, bs=4, nb=8, ns=[300]),
        dict(t=16, h=32, di=128, k=512, bs=8, nb=2048, ns=[8192, 524288]),
    )
    paged = _dims(scale, dict(t=5, b=3, n=40, epb=4), dict(t=64, b=64, n=4096, epb=64))
    return [c for n in dm["ns"] for c in _indexer_case(n, dm, timing, tuned=tuned)] + _indexer_paged_case(
        dict(dm, **paged), timing, tuned=tuned
    )


def _indexer_case(n: int, dm: dict, timing: bool, *, tuned: KernelConfigs = DEFAULT) -> list[Check]:
    from flashpd.kernels.indexer import ref as iref
    from flashpd.kernels.indexer import triton as it

    it = dispatch.bind(it, tuned)
    from flashpd.kernels.quant import ref as qref

    out = []
    q, w, rec, n_vis = _index_inputs(dm["t"], n, dm["h"], dm["di"], seed=30)
    keys = qref.unpack_mxfp4(rec, torch.bfloat16)
    ref_scores = iref.index_scores(q, w, keys, n_vis)
    out += _indexer_scores_checks(it, iref, (q, w, rec, n_vis), keys, ref_scores, n, dm, timing)
    return out + _indexer_selection_checks(it, iref, (q, w, rec, n_vis), ref_scores, n, dm, timing)


def _indexer_scores_checks(it, iref, inputs, keys, ref_scores, n: int, dm: dict, timing: bool) -> list[Check]:
    """Packed-MXFP4 scoring against the reference, then scoring from unpacked keys."""
    q, w, rec, n_vis = inputs
    out = []
    scores = it.index_scores_packed(q, w, rec, n_vis)
    sc = close_check("indexer", f"scores packed MXFP4 N={n}", scores, ref_scores, 1e-5)
    sc.bytes_moved = dm["t"] * n * (rec.shape[1] + 4)
    sc.flops = 2.0 * dm["t"] * n * dm["h"] * dm["di"]
    out.append(
        _timed(
            sc, timing, lambda: it.index_scores_packed(q, w, rec, n_vis), lambda: iref.index_scores(q, w, keys, n_vis)
        )
    )
    out.append(close_check("indexer", f"scores values N={n}", it.index_scores(q, w, keys, n_vis), ref_scores, 1e-5))
    return out


def _indexer_selection_checks(it, iref, inputs, ref_scores, n: int, dm: dict, timing: bool) -> list[Check]:
    """Top-k, the layer-20 candidate mask and the sparse re-index over candidate blocks."""
    q, w, rec, n_vis = inputs
    out = []
    topk = selection_check(
        "indexer",
        f"top-{dm['k']} ascending N={n}",
        it.select_topk(ref_scores, dm["k"]),
        iref.select_topk(ref_scores, dm["k"]),
        ref_scores,
        0.0,
    )
    out.append(
        _timed(topk, timing, lambda: it.select_topk(ref_scores, dm["k"]), lambda: iref.select_topk(ref_scores, dm["k"]))
    )
    ref_mask = iref.candidate_mask(ref_scores, n_vis, dm["bs"], dm["nb"])
    out.append(
        exact_check(
            "indexer",
            f"layer-20 candidate mask N={n}",
            it.candidate_mask(ref_scores, n_vis, dm["bs"], dm["nb"]),
            ref_mask,
        )
    )
    return out + [_indexer_sparse_check(it, iref, inputs, ref_scores, ref_mask, n, dm, timing)]


def _indexer_sparse_check(it, iref, inputs, ref_scores, ref_mask, n: int, dm: dict, timing: bool) -> Check:
    """The sparse re-index against dense scoring + masked top-k (its speed-up in the note)."""
    q, w, rec, n_vis = inputs
    blocks = it.candidate_blocks(ref_scores, n_vis, dm["bs"], dm["nb"])
    ref_sel = iref.select_topk(ref_scores, dm["k"], allowed=ref_mask)
    sparse = selection_check(
        "indexer",
        f"sparse reindex top-k N={n}",
        it.index_topk_sparse(q, w, rec, n_vis, blocks, dm["bs"], dm["k"]),
        ref_sel,
        ref_scores,
        1e-5,
    )

    def dense_path():
        s = it.index_scores_packed(q, w, rec, n_vis)
        return it.select_topk(s, dm["k"], allowed=ref_mask)

    def sparse_path():
        return it.index_topk_sparse(q, w, rec, n_vis, blocks, dm["bs"], dm["k"])

    _timed(sparse, timing, sparse_path, dense_path)
    if sparse.kernel_ms and sparse.ref_ms:
        sparse.note += f"; sparse {sparse.ref_ms / sparse.kernel_ms:.2f}x vs dense scoring"
        sparse.extra["dense_ms"] = sparse.ref_ms
    return sparse


def _paged_index_inputs(dm: dict, seed: int):
    """B sequences of random lengths (<= N, the last full) in shuffled pool blocks, T queries."""
    from flashpd.kernels.indexer import ref as iref
    from flashpd.kernels.quant import ref as qref

    t, b, n, epb = dm["t"], dm["b"], dm["n"], dm["epb"]
    g = torch.Generator().manual_seed(seed)
    num_entries = torch.randint(0, n + 1, (b,), generator=g).tolist()
    num_entries[-1] = n
    need = [-(-e // epb) for e in num_entries]
    perm = torch.randperm(sum(need) + 2, generator=g).tolist()  # 2 spare blocks
    tables = [perm[sum(need[:i]) : sum(need[: i + 1])] for i in range(b)]
    pool = qref.pack_mxfp4(randn(len(perm) * epb, dm["di"], seed=seed + 1, dtype=torch.float32))
    key_rows = iref.paged_key_rows(tables, epb, num_entries, n, device())
    seq_of = torch.arange(t) % b
    n_vis = (torch.rand(t, generator=g) * (torch.tensor(num_entries)[seq_of] + 1)).long()
    n_vis[seq_of == b - 1] = n  # the full sequence's queries see all N entries
    q = qref.fake_quant_mxfp4(randn(t, dm["h"], dm["di"], seed=seed + 2, dtype=torch.float32)).bfloat16()
    w = randn(t, dm["h"], seed=seed + 3, scale=1 / 64, dtype=torch.float32)
    return (q, w, pool, key_rows, seq_of.to(torch.int32).to(device()), n_vis.to(torch.int32).to(device()), num_entries)


def _indexer_paged_case(dm: dict, timing: bool, *, tuned: KernelConfigs = DEFAULT) -> list[Check]:
    """One launch over a paged pool vs the per-sequence path (gather, one launch per sequence)."""
    from flashpd.kernels.indexer import ref as iref
    from flashpd.kernels.indexer import triton as it

    it = dispatch.bind(it, tuned)

    q, w, pool, key_rows, seq_of, n_vis, num_entries = _paged_index_inputs(dm, seed=34)
    label = f"B={dm['b']} N={dm['n']}"
    exact, scores = _paged_exact_check(it, (q, w, pool, key_rows, seq_of, n_vis), num_entries, dm, label, timing)
    out = [exact]
    ref_scores = iref.index_scores_paged(q, w, pool, key_rows, seq_of, n_vis)
    out.append(close_check("indexer", f"paged scores vs ref {label}", scores, ref_scores, 1e-5))
    return out + [_paged_sparse_check(it, iref, (q, w, pool, key_rows, seq_of, n_vis), ref_scores, dm, timing)]


def _paged_exact_check(it, inputs, num_entries: list[int], dm: dict, label: str, timing: bool):
    """One paged launch against per-sequence gather + launch (bit-equal); with the scores."""
    q, w, pool, key_rows, seq_of, n_vis = inputs
    per_query = [(seq_of == b).nonzero().flatten() for b in range(dm["b"])]

    def per_sequence():
        out = torch.full((dm["t"], dm["n"]), float("-inf"), device=device())
        for b, queries in enumerate(per_query):
            records = pool[key_rows[b, : num_entries[b]].long()]  # the gather copy
            out[queries, : num_entries[b]] = it.index_scores_packed(q[queries], w[queries], records, n_vis[queries])
        return out

    def paged():
        return it.index_scores_paged(q, w, pool, key_rows, seq_of, n_vis)

    scores = paged()
    exact = close_check(
        "indexer",
        f"paged scores T={dm['t']} {label}",
        scores,
        per_sequence(),
        0.0,
        note="vs per-sequence index_scores_packed",
    )
    exact.bytes_moved = dm["t"] * dm["n"] * (pool.shape[1] + 4 + 4)
    exact.flops = 2.0 * dm["t"] * dm["n"] * dm["h"] * dm["di"]
    _timed(exact, timing, paged, per_sequence)
    if exact.kernel_ms and exact.ref_ms:
        exact.note += f"; batched {exact.ref_ms / exact.kernel_ms:.2f}x"
    return exact, scores


def _paged_sparse_check(it, iref, inputs, ref_scores, dm: dict, timing: bool) -> Check:
    """The paged sparse re-index against its reference, a quarter of the entries as candidates."""
    q, w, pool, key_rows, seq_of, n_vis = inputs
    nb = max(1, dm["n"] // (4 * dm["bs"]))  # a quarter of the entries: the mask bites
    blocks = it.candidate_blocks(ref_scores, n_vis, dm["bs"], nb)
    args = (q, w, pool, key_rows, seq_of, n_vis, blocks, dm["bs"], dm["k"])
    sparse = selection_check(
        "indexer",
        f"paged sparse top-{dm['k']} N={dm['n']} nb={nb}",
        it.index_topk_sparse_paged(*args),
        iref.index_topk_sparse_paged(*args),
        ref_scores,
        1e-5,
    )
    return _timed(sparse, timing, lambda: it.index_topk_sparse_paged(*args))


# ============================================================================ 5. attention
@register_check("attention")
def check_attention(scale: str, timing: bool, *, tuned: KernelConfigs = DEFAULT) -> list[Check]:
    from flashpd.kernels.attention import ref as aref
    from flashpd.kernels.attention import triton as at

    at = dispatch.bind(at, tuned)

    dm = _dims(
        scale,
        dict(ts=[3], h=4, d=64, w=8, k=6, rp=8, entries=40),
        dict(ts=[64, 1024], h=64, d=512, w=128, k=512, rp=32, entries=65536),
    )
    out = [c for t in dm["ts"] for c in _attention_case(t, dm, timing, tuned=tuned)]
    t = dm["ts"][0]
    q = randn(t, dm["h"], dm["d"], seed=46)
    keys = randn(t, dm["w"] + dm["k"], dm["d"], seed=47)
    valid = (torch.rand(t, dm["w"] + dm["k"], generator=torch.Generator().manual_seed(48)) > 0.2).to(device())
    sink = randn(dm["h"], seed=49, dtype=torch.float32)
    out.append(
        close_check(
            "attention",
            f"sparse_attention (ref signature) T={t}",
            at.sparse_attention(q, keys, valid, sink, dm["d"] ** -0.5),
            aref.sparse_attention(q, keys, valid, sink, dm["d"] ** -0.5),
            2e-2,
        )
    )
    return out


def _attention_inputs(t: int, dm: dict):
    """Queries, sinks, RoPE, an FP8 window pool with rows (a quarter not yet written) and
    compressed rows (an eighth padding) into `entries` compressed values."""
    from flashpd.kernels.quant import ref as qref

    h, d, w, k = dm["h"], dm["d"], dm["w"], dm["k"]
    q = randn(t, h, d, seed=40)
    sink = randn(h, seed=41, dtype=torch.float32)
    rope_tables = _rope(t, dm["rp"], seed=42)
    win_pool = qref.pack_window_fp8(randn(t * w, d, seed=43, dtype=torch.float32))
    g = torch.Generator().manual_seed(44)
    win_rows = torch.randperm(t * w, generator=g).reshape(t, w)
    win_rows[:, : w // 4] = -1  # a window not yet full
    comp_rows = torch.randint(0, dm["entries"], (t, k), generator=g)
    comp_rows[:, -k // 8 :] = -1
    win_rows, comp_rows = win_rows.to(device()), comp_rows.to(device())
    comp_vals = randn(dm["entries"], d, seed=45, dtype=torch.float32)
    return q, sink, rope_tables, win_pool, win_rows, comp_rows, comp_vals


def _attention_reference(inputs, comp_pool, unpack, scale_: float) -> torch.Tensor:
    """RoPE'd queries on unpacked window + compressed keys, the output de-rotated (as the kernel)."""
    from flashpd.kernels.attention import ref as aref
    from flashpd.kernels.quant import ref as qref
    from flashpd.kernels.rope import ref as rope

    q, sink, (pos, freqs, _), win_pool, win_rows, comp_rows, _ = inputs
    keys = torch.cat(
        (
            qref.unpack_window_fp8(win_pool, torch.bfloat16)[win_rows.clamp_min(0)],
            unpack(comp_pool, torch.bfloat16)[comp_rows.clamp_min(0)],
        ),
        dim=1,
    )
    valid = torch.cat((win_rows >= 0, comp_rows >= 0), dim=1)
    o = aref.sparse_attention(rope.apply_rope(q, pos, freqs), keys, valid, sink, scale_)
    return rope.apply_rope(o, pos, freqs, inverse=True)


def _attention_format_check(at, inputs, fmt: int, pack, unpack, label: str, t: int, dm: dict, timing: bool) -> Check:
    """The packed kernel with compressed KV in `fmt` against the reference on unpacked keys."""
    h, d, w, k = dm["h"], dm["d"], dm["w"], dm["k"]
    q, sink, (pos, freqs, tables), win_pool, win_rows, comp_rows, comp_vals = inputs
    scale_ = d**-0.5
    comp_pool = pack(comp_vals)

    def kernel():
        return at.sparse_attention_packed(
            q, tables, win_pool, win_rows, comp_pool, comp_rows, sink, scale_, comp_format=fmt
        )

    def reference():
        return _attention_reference(inputs, comp_pool, unpack, scale_)

    chk = close_check("attention", f"packed {label} comp T={t}", kernel(), reference(), 2e-2)
    chk.bytes_moved = t * (w * 528 / 512 * d + k * comp_pool.shape[1] + 4 * h * d)
    chk.flops = 4.0 * t * h * (w + k) * d
    return _timed(chk, timing, kernel, reference)


def _attention_case(t: int, dm: dict, timing: bool, *, tuned: KernelConfigs = DEFAULT) -> list[Check]:
    from flashpd.kernels.attention import triton as at

    at = dispatch.bind(at, tuned)
    from flashpd.kernels.quant import ref as qref

    out = []
    inputs = _attention_inputs(t, dm)
    for fmt, pack, unpack, label in (
        (at.FMT_NVFP4, qref.pack_nvfp4, qref.unpack_nvfp4, "NVFP4"),
        (at.FMT_FP8, qref.pack_window_fp8, qref.unpack_window_fp8, "FP8"),
    ):
        out.append(_attention_format_check(at, inputs, fmt, pack, unpack, label, t, dm, timing))
    if timing and out[-2].kernel_ms and out[-1].kernel_ms:
        out[-2].note = f"NVFP4 {out[-1].kernel_ms / out[-2].kernel_ms:.2f}x vs FP8 comp KV"
    return out


# ============================================================================ 6. GEMMs
@register_check("gemm")
def check_gemm(scale: str, timing: bool, *, tuned: KernelConfigs = DEFAULT) -> list[Check]:
    from flashpd.kernels.dense import ref as dref
    from flashpd.kernels.dense import triton as dt

    dt = dispatch.bind(dt, tuned)
    from flashpd.kernels.quant import ref as qref

    out = []
    shapes = [(5, 70, 96)] if scale == "tiny" else [(16, 5120, 8192), (4096, 5120, 8192)]
    for t, n, k in shapes:
        out.append(_check_linear_fp8(dt, dref, qref, t, n, k, timing))
    out.extend(_check_fp8_prefill(scale, tuned=tuned))
    t, d, i, e, k = (12, 64, 64, 4, 2) if scale == "tiny" else (4096, 5120, 2304, 64, 6)
    out.extend(_check_grouped(t, d, i, e, k, timing, tuned=tuned))
    if scale == "tiny":
        out.extend(_check_norm_and_fp32(dt, dref))
    return out


def _check_linear_fp8(dt, dref, qref, t: int, n: int, k: int, timing: bool) -> Check:
    """The FP8 (32x32 block scales) linear against bf16 on the dequantised weight."""
    x = randn(t, k, seed=50)
    w_f8, s8 = qref.quantize_fp8_blockwise(randn(n, k, seed=51, dtype=torch.float32))
    w_deq = qref.dequantize_fp8_blockwise(w_f8, s8)
    chk = close_check(
        "gemm", f"FP8 32x32 linear T={t} N={n} K={k}", dt.linear_fp8(x, w_f8, s8), dref.linear(x, w_deq), 8e-3
    )
    chk.flops, chk.bytes_moved = 2.0 * t * n * k, n * k + t * (k + n) * 2
    _timed(chk, timing, lambda x=x, w=w_f8, s=s8: dt.linear_fp8(x, w, s), lambda x=x, w=w_deq: torch.matmul(x, w.T))
    if chk.ref_ms:
        chk.note = "ref_ms = cuBLAS bf16 on dequantised W"
    return chk


def _check_norm_and_fp32(dt, dref) -> list[Check]:
    """RMSNorm and the IEEE fp32 linear (tiny scale only)."""
    x = randn(7, 96, seed=52)
    norm = close_check(
        "gemm", "rms_norm", dt.rms_norm(x, randn(96, seed=53), 1e-20), dref.rms_norm(x, randn(96, seed=53), 1e-20), 8e-3
    )
    xf = randn(7, 96, seed=54, dtype=torch.float32)
    wf = randn(24, 96, seed=55, dtype=torch.float32)
    return [norm, close_check("gemm", "linear_fp32 (IEEE)", dt.linear_fp32(xf, wf), dref.linear_fp32(xf, wf), 1e-5)]


def _check_fp8_prefill(scale: str, *, tuned: KernelConfigs = DEFAULT) -> list[Check]:
    """The FP8 GEMMs a prefill runs besides single weights: the shared expert's SwiGLU pair
    and wo_a's block-diagonal groups (cuBLAS on the GPU from cublas_min_rows rows per weight,
    the Triton kernel below that and under the interpreter)."""
    from flashpd.kernels.dense import ref as dref
    from flashpd.kernels.dense import triton as dt

    dt = dispatch.bind(dt, tuned)
    from flashpd.kernels.quant import ref as qref

    t, d, i, g, n, k = (6, 64, 32, 2, 32, 64) if scale == "tiny" else (4096, 5120, 2304, 8, 1024, 4096)
    limit = 7.0
    x = randn(t, d, seed=56)
    (w1, s1), (w3, s3) = (qref.quantize_fp8_blockwise(randn(i, d, seed=s, dtype=torch.float32)) for s in (57, 58))
    gam = torch.rand(t, generator=torch.Generator().manual_seed(59)).to(x.device) + 0.5
    h = torch.empty(t, i, dtype=x.dtype, device=x.device)
    dt.grouped_gemm(
        x, dt.Weights.fp8(w1, s1), None, h, w3=dt.Weights.fp8(w3, s3), gamma=gam, limit=limit, cfg=tuned.dense
    )
    gr = dref.linear(x, qref.dequantize_fp8_blockwise(w1, s1)).float().clamp_max(limit)
    ur = dref.linear(x, qref.dequantize_fp8_blockwise(w3, s3)).float().clamp(-limit, limit)
    ref = (gam[:, None] * torch.nn.functional.silu(gr) * ur).to(x.dtype)
    out = [close_check("gemm", f"FP8 SwiGLU pair (shared expert) T={t} I={i} K={d}", h, ref, 8e-3)]
    return out + [_check_block_diagonal(dt, dref, qref, t, g, n, k)]


def _check_block_diagonal(dt, dref, qref, t: int, g: int, n: int, k: int) -> Check:
    """wo_a's G block-diagonal FP8 groups in one launch against G reference linears."""
    xs = randn(t, g, k, seed=60)
    ws = [qref.quantize_fp8_blockwise(randn(n, k, seed=61 + j, dtype=torch.float32)) for j in range(g)]
    wb = dt.Weights.fp8(torch.stack([w for w, _ in ws]), torch.stack([s for _, s in ws]))
    ref = torch.stack([dref.linear(xs[:, j], qref.dequantize_fp8_blockwise(*ws[j])) for j in range(g)], dim=1)
    return close_check(
        "gemm", f"FP8 block-diagonal (wo_a) T={t} G={g} N={n} K={k}", dt.block_diagonal(xs, wb), ref, 8e-3
    )


def _random_mxfp4(e: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(118, 123, (e, n, k // 32), generator=g, dtype=torch.uint8)
    return packed.to(device()), scale.to(device())


def _grouped_inputs(t: int, d: int, i: int, e: int, k: int):
    """Tokens, k distinct experts per token, their gates, and random MXFP4 W1 / W3 / W2."""
    x = randn(t, d, seed=56)
    g = torch.Generator().manual_seed(57)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device())
    gam = randn(t, k, seed=58, scale=0.3, dtype=torch.float32).abs()
    ws = [_random_mxfp4(e, i, d, 60), _random_mxfp4(e, i, d, 61), _random_mxfp4(e, d, i, 62)]
    return x, ids, gam, ws


def _dequantized_experts(ws: list, e: int) -> list[torch.Tensor]:
    """W1 / W3 / W2 of every expert dequantised from MXFP4 (the reference's weights)."""
    from flashpd.kernels.quant import ref as qref

    return [torch.stack([qref.dequantize_mxfp4_weight(p[j], s[j]) for j in range(e)]) for p, s in ws]


def _grouped_reference(mref, x, ids, gam, deq: list, e: int) -> torch.Tensor:
    """Every expert's reference FFN on its tokens, gate-weighted, summed per token in fp32."""
    acc = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=device())
    for j in range(e):
        tok, slot = torch.nonzero(ids == j, as_tuple=True)
        if tok.numel():
            y = mref.expert_ffn(x[tok], deq[0][j], deq[1][j], deq[2][j], 10.0, gam[tok, slot][:, None])
            acc.index_add_(0, tok, y.float())
    return acc


def _check_grouped(
    t: int, d: int, i: int, e: int, k: int, timing: bool, *, tuned: KernelConfigs = DEFAULT
) -> list[Check]:
    from flashpd.kernels.dense import triton as dt

    dt = dispatch.bind(dt, tuned)
    from flashpd.kernels.moe import ref as mref
    from flashpd.kernels.moe import triton as mt

    mt = dispatch.bind(mt, tuned)

    x, ids, gam, ws = _grouped_inputs(t, d, i, e, k)
    experts = mt.ExpertSet(*(dt.Weights.mxfp4(p, s) for p, s in ws))
    deq = _dequantized_experts(ws, e)

    def reference():
        return _grouped_reference(mref, x, ids, gam, deq, e)

    label = f"MXFP4 grouped experts T={t} E={e} k={k}"
    chk = close_check("gemm", label, mt.routed_experts(x, ids, gam, experts, 10.0), reference(), 1e-2)
    chk.flops = 6.0 * t * k * d * i
    chk.bytes_moved = 3 * e * i * d * (0.5 + 1 / 32) + t * d * 2 * 2
    out = [_timed(chk, timing, lambda: mt.routed_experts(x, ids, gam, experts, 10.0), reference, reps=10)]
    if device().type == "cuda":
        out.append(_check_dot_scaled(x, ids, gam, experts, t, e, k, d, i, timing, tuned=tuned))
    return out


def _dot_scaled_failed(exc: Exception) -> Check:
    """A failed check naming the exception (the dot_scaled switch is experimental on Hopper)."""
    note = f"dot_scaled failed: {type(exc).__name__}: {exc}"[:160]
    return Check("gemm", "MXFP4 W1 via tl.dot_scaled", float("nan"), float("nan"), 1e-2, False, note=note)


def _check_dot_scaled(x, ids, gam, experts, t, e, k, d, i, timing, *, tuned: KernelConfigs = DEFAULT) -> Check:
    """The constexpr DOT_SCALED path of the grouped GEMM (GPU only): W1 of every pair."""
    from flashpd.kernels.dense import triton as dt

    dt = dispatch.bind(dt, tuned)

    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = (order // k).to(torch.int32)
    sched = dt.grouped_schedule(torch.bincount(flat, minlength=e), t * k, 64)
    out_a = torch.empty(t * k, i, dtype=torch.float32, device=x.device)
    out_b = torch.empty_like(out_a)
    dt.grouped_gemm(x, experts.w1, sched, out_a, a_rows=rows, cfg=tuned.dense)
    try:
        dt.grouped_gemm(x, experts.w1, sched, out_b, a_rows=rows, dot_scaled=True, cfg=tuned.dense)
    except Exception as exc:  # report, do not hide: the switch is experimental on Hopper
        return _dot_scaled_failed(exc)
    chk = close_check("gemm", "MXFP4 W1 via tl.dot_scaled", out_b, out_a, 1e-2)
    chk.flops = 2.0 * t * k * d * i
    return _timed(
        chk,
        timing,
        lambda: dt.grouped_gemm(x, experts.w1, sched, out_b, a_rows=rows, dot_scaled=True, cfg=tuned.dense),
        lambda: dt.grouped_gemm(x, experts.w1, sched, out_a, a_rows=rows, cfg=tuned.dense),
    )


# ============================================================================ 7. Engram
@register_check("engram")
def check_engram(scale: str, timing: bool, *, tuned: KernelConfigs = DEFAULT) -> list[Check]:
    from flashpd.kernels.engram import ref as eref
    from flashpd.kernels.engram import triton as et

    et = dispatch.bind(et, tuned)
    from flashpd.kernels.quant import ref as qref

    dm = _dims(scale, dict(t=5, c=6, rows=500, r=32, d=64), dict(t=4096, c=24, rows=24 * 100_003, r=256, d=5120))
    chk, rows = _engram_gather_check(et, qref, dm, timing)
    return [chk] + _engram_inject_checks(et, eref, rows, dm)


def _engram_rows(dm: dict):
    """A random FP8 table (no NaN codes) with its UE8M0 scales, and T x C row ids into it."""
    g = torch.Generator().manual_seed(70)
    w_bytes = torch.randint(0, 256, (dm["rows"], dm["r"]), generator=g, dtype=torch.uint8)
    w_bytes[(w_bytes & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    scales = torch.randint(120, 130, (dm["rows"], dm["r"] // 32), generator=g, dtype=torch.uint8)
    ids = torch.randint(0, dm["rows"], (dm["t"], dm["c"]), generator=g)
    return w_bytes.view(torch.float8_e4m3fn), scales, ids


def _engram_gather_check(et, qref, dm: dict, timing: bool):
    """The zero-copy host-table gather against plain gather + copy + dequantise; with its rows."""
    w_f8, scales, ids = _engram_rows(dm)
    table = et.HostTable.from_quantized(w_f8, scales)
    expect = qref.dequantize_fp8_rows(w_f8[ids.reshape(-1)], scales[ids.reshape(-1)])
    ids_dev = ids.to(device())
    rows = et.gather_rows(table, ids_dev)
    chk = exact_check("engram", f"host-table gather T={dm['t']} C={dm['c']}", rows.reshape(-1, dm["r"]).cpu(), expect)
    chk.bytes_moved = ids.numel() * (dm["r"] * (1 + 2) + dm["r"] // 32)
    chk.extra.update(huge_pages=table.huge_pages, pinned=table.pinned, thp=et.transparent_huge_pages_mode())

    def plain():  # host gather on a pageable table, copy, dequantise on the device
        flat = ids.reshape(-1)
        wq = w_f8[flat].to(device())
        sq = scales[flat].to(device())
        return qref.dequantize_fp8_rows(wq, sq)

    _timed(chk, timing, lambda: et.gather_rows(table, ids_dev), plain, reps=10)
    if chk.kernel_ms and chk.ref_ms:
        chk.note += (
            f"; zero-copy {chk.ref_ms / chk.kernel_ms:.2f}x vs plain gather+copy (huge pages: {table.huge_pages})"
        )
    return chk, rows


def _engram_inject_checks(et, eref, rows, dm: dict) -> list[Check]:
    """Inject (GEMM + fused gate) and the gates alone, on the gathered rows as features."""
    out = []
    t, s, d = min(dm["t"], 64), 4, dm["d"]
    x = randn(t, s, d, seed=71)
    feats = rows[:t]
    wkv = randn((s + 1) * d, feats.shape[1], seed=72, scale=feats.shape[1] ** -0.5)
    qk = randn(s, d, seed=73, dtype=torch.float32)
    out.append(
        close_check(
            "engram",
            f"inject (GEMM + fused gate) T={t}",
            et.engram_inject(x, feats, wkv, qk, 1e-20),
            eref.engram_inject(x, feats, wkv, qk, 1e-20),
            2e-2,
        )
    )
    keys = randn(t, s, d, seed=74)
    out.append(
        close_check(
            "engram", f"gates T={t}", et.engram_gates(x, keys, qk, 1e-20), eref.engram_gates(x, keys, qk, 1e-20), 1e-4
        )
    )
    return out


# ============================================================================ forward glue
@register_check("glue")
def check_glue(scale: str, timing: bool, *, tuned: KernelConfigs = DEFAULT) -> list[Check]:
    """The GPU forward's fused glue: the index query (RoPE + MXFP4 values per head, one launch),
    the ratio-2 compressor pooling, and top-k emitted as pool rows."""
    dm = _dims(
        scale, dict(t=12, h=4, di=32, rp=8, c=64, n=40, k=8), dict(t=8192, h=32, di=128, rp=32, c=512, n=4096, k=512)
    )
    return [_glue_index_query(dm, timing, tuned), _glue_pool(dm, timing, tuned), _glue_topk_rows(dm, tuned)]


def _glue_index_query(dm: dict, timing: bool, tuned: KernelConfigs) -> Check:
    """RoPE + MXFP4 fake-quant of the index query, every head in one launch."""
    from flashpd.kernels.quant import ref as qref
    from flashpd.kernels.quant import triton as qt

    qt = dispatch.bind(qt, tuned)

    t, h, di = dm["t"], dm["h"], dm["di"]
    q = randn(t * h, di, seed=81, scale=3.0)
    _, _, tables = _rope(t, dm["rp"], seed=82)
    chk = exact_check(
        "glue",
        f"index query T={t} h={h} dI={di}",
        qt.rope_fake_quant_mxfp4(q, tables, h),
        qref.rope_fake_quant_mxfp4(q, tables, h),
    )
    chk.bytes_moved = 2 * q.numel() * 2
    return _timed(
        chk, timing, lambda: qt.rope_fake_quant_mxfp4(q, tables, h), lambda: qref.rope_fake_quant_mxfp4(q, tables, h)
    )


def _glue_pool(dm: dict, timing: bool, tuned: KernelConfigs) -> Check:
    """The ratio-2 compressor pooling of open pairs (some stored this step)."""
    from flashpd.kernels.compressor import ref as cref
    from flashpd.kernels.compressor import triton as ct

    ct = dispatch.bind(ct, tuned)

    t, c = dm["t"], dm["c"]
    ag = randn(t, 2, c, seed=83, scale=4.0, dtype=torch.float32)
    open_rows = randn(3, 2, c, seed=84, scale=4.0, dtype=torch.float32)
    stored = torch.zeros(t, dtype=torch.bool, device=device())
    stored[::5] = True
    slots = torch.arange(t, device=device()) % 3
    chk = exact_check(
        "glue",
        f"compressor pool T={t} c={c}",
        ct.pool_open_pairs(ag, open_rows, stored, slots),
        cref.pool_open_pairs(ag, open_rows, stored, slots),
    )
    chk.bytes_moved = ag.numel() * 4 + t * c * 2
    return _timed(
        chk,
        timing,
        lambda: ct.pool_open_pairs(ag, open_rows, stored, slots),
        lambda: cref.pool_open_pairs(ag, open_rows, stored, slots),
    )


def _glue_topk_rows(dm: dict, tuned: KernelConfigs) -> Check:
    """Top-k emitted as pool rows through (key_rows, seq_of) instead of entry ids."""
    from flashpd.kernels.indexer import ref as iref
    from flashpd.kernels.indexer import triton as it

    it = dispatch.bind(it, tuned)

    rows_t = min(dm["t"], 64)
    scores = randn(rows_t, dm["n"], seed=85, dtype=torch.float32)
    key_rows = (
        torch.randperm(4 * dm["n"], generator=torch.Generator().manual_seed(86))[: 2 * dm["n"]]
        .view(2, dm["n"])
        .to(torch.int32)
        .to(device())
    )
    seq_of = (torch.arange(rows_t, device=device()) % 2).to(torch.int32)
    ids = it.select_topk(scores, dm["k"])
    return exact_check(
        "glue",
        f"top-k as pool rows T={rows_t} N={dm['n']}",
        it.select_topk(scores, dm["k"], pool_rows=(key_rows, seq_of)),
        iref.to_pool_rows(ids, key_rows, seq_of),
    )
