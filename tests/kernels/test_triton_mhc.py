"""Fused mHC step (kernels/mhc/triton.py) against the ref sequence expand -> mixes -> collapse."""

from __future__ import annotations

import pytest
import torch

from flashpd.kernels import configs, triton_runtime
from flashpd.kernels.dense import ref as dref
from flashpd.kernels.mhc import ref as href
from flashpd.kernels.mhc import triton as ht


def _site(t: int = 7, d: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 4, d, generator=g).bfloat16()
    fn = torch.randn(24, 4 * d, generator=g) * (4 * d) ** -0.5
    base = torch.randn(24, generator=g) * 0.5
    scale = torch.tensor([1.0, 0.5, 2.0])
    return x, fn, base, scale


def test_mixes_match_reference():
    x, fn, base, scale = _site()
    for got, want in zip(
        ht.hc_mixes(x, fn, base, scale, 20, 1e-6, 1e-20),
        href.hc_mixes(x, fn, base, scale, 20, 1e-6, 1e-20),
        strict=True,
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fused_step_matches_expand_mixes_collapse_norm():
    x, fn, base, scale = _site(seed=1)
    g = torch.Generator().manual_seed(2)
    y = torch.randn(7, 64, generator=g).bfloat16()
    norm_w = torch.randn(64, generator=g).bfloat16()
    pre_in, post, comb = href.hc_mixes(x, fn, base, scale, 20, 1e-6, 1e-20)
    out = ht.expand_mix_collapse(y, x, post, comb, fn, base, scale, 20, 1e-6, 1e-20, pre_in, norm_w)
    _assert_fused_close(out, y, x, post, comb, fn, base, scale, pre_in, norm_w)


def _assert_fused_close(out, y, x, post, comb, fn, base, scale, pre_in, norm_w, mixes_of_kernel_streams=False):
    """The fused step's outputs against expand -> mixes -> collapse -> RMSNorm (the mixes of
    the ref's X', or of the kernel's X' when asked)."""
    new, pre, post2, comb2, xc = out
    want = href.expand(y, x, post, comb)
    torch.testing.assert_close(new.float(), want.float(), rtol=8e-3, atol=1e-5)
    streams = new if mixes_of_kernel_streams else want
    for got, ref in zip((pre, post2, comb2), href.hc_mixes(streams, fn, base, scale, 20, 1e-6, 1e-20), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    ref_x = dref.rms_norm(href.collapse(want, pre_in), norm_w, 1e-20)
    torch.testing.assert_close(xc.float(), ref_x.float(), rtol=2e-2, atol=1e-2)


def test_sinkhorn_columns_sum_to_one():
    logits = torch.randn(5, 4, 4, generator=torch.Generator().manual_seed(3)) * 3
    comb = ht.sinkhorn(logits, 20, 1e-6)
    torch.testing.assert_close(comb, href.sinkhorn(logits, 20, 1e-6), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb.sum(dim=1), torch.ones(5, 4), rtol=1e-4, atol=1e-4)


def test_collapse_and_expand_match_reference():
    x, fn, base, scale = _site(seed=4)
    pre, post, comb = href.hc_mixes(x, fn, base, scale, 20, 1e-6, 1e-20)
    y = torch.randn(7, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    assert torch.equal(ht.collapse(x, pre), href.collapse(x, pre))
    torch.testing.assert_close(
        ht.expand(y, x, post, comb).float(), href.expand(y, x, post, comb).float(), rtol=8e-3, atol=1e-5
    )


def test_only_four_streams_are_supported():
    x = torch.randn(2, 3, 32)
    with pytest.raises(ValueError, match="streams"):
        ht.hc_mixes(x, torch.randn(15, 96), torch.randn(15), torch.ones(3), 20, 1e-6, 1e-20)


def test_split_over_d_matches_reference_and_leaves_counters_reset():
    # D = 256 spreads each token block over MHC_SPLIT programs (last arriver finishes)
    x, fn, base, scale = _site(t=5, d=256, seed=6)
    for _ in range(2):  # a second launch needs the arrival counters back at zero
        got = ht.hc_mixes(x, fn, base, scale, 20, 1e-6, 1e-20)
        for g, w in zip(got, href.hc_mixes(x, fn, base, scale, 20, 1e-6, 1e-20), strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert int(triton_runtime.arrival_counters(torch.device("cpu")).abs().sum()) == 0


def _mhc(**fields) -> configs.KernelConfigs:
    """The default configs with these mHC launch fields."""
    return configs.override(configs.DEFAULT, mhc=fields)


def _fused(t: int, d: int, seed: int):
    x, fn, base, scale = _site(t=t, d=d, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    y = torch.randn(t, d, generator=g).bfloat16()
    norm_w = torch.randn(d, generator=g).bfloat16()
    pre_in, post, comb = href.hc_mixes(x, fn, base, scale, 20, 1e-6, 1e-20)
    return (y, x, post, comb, fn, base, scale, 20, 1e-6, 1e-20, pre_in, norm_w)


@pytest.mark.parametrize("block_d", [64, 32])
def test_prefill_tiles_match_reference_and_every_grid_gives_the_same_bits(block_d):
    # 70 tokens > decode_rows: prefill tiles; D = 256 is 4 slices, spread over 1, 2 or 4
    # programs per token block, always added in slice order -> identical results
    args = _fused(70, 256, 7)
    runs = []
    for grid in (1, 2, 4):
        tuned = _mhc(decode_rows=16, prefill_block_d=block_d, prefill_grid=grid)
        assert ht.launch_plan(70, 256, tuned.mhc)["grid"] == grid
        runs.append(ht.expand_mix_collapse(*args, tuned=tuned))
    for run in runs[1:]:
        for a, b in zip(runs[0], run, strict=True):
            assert torch.equal(a, b)
    y, x, post, comb, fn, base, scale, _, _, _, pre_in, norm_w = args
    want = href.expand(y, x, post, comb)
    new, pre, post2, comb2, xc = runs[0]
    torch.testing.assert_close(new.float(), want.float(), rtol=8e-3, atol=1e-5)
    # mixes of the kernel's own X' (a few X' elements may differ by one BF16 ulp from the
    # ref's bmm, whose summation order is MKL's)
    for got, ref in zip((pre, post2, comb2), href.hc_mixes(new, fn, base, scale, 20, 1e-6, 1e-20), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    ref_x = dref.rms_norm(href.collapse(want, pre_in), norm_w, 1e-20)
    torch.testing.assert_close(xc.float(), ref_x.float(), rtol=2e-2, atol=1e-2)
    assert int(triton_runtime.arrival_counters(torch.device("cpu")).abs().sum()) == 0


def test_decode_rows_do_not_depend_on_the_batch():
    # a token's outputs are the same bits alone and in a batch of 19 (decode tiles); row 5 is
    # normalised by the tile pass in the batch (a full block) and by the flat pass alone
    args = _fused(19, 256, 8)
    batch = ht.expand_mix_collapse(*args)
    for i in (5, 17):
        one = ht.expand_mix_collapse(*(a[i : i + 1] if j in (0, 1, 2, 3, 10) else a for j, a in enumerate(args)))
        for a, b in zip(batch, one, strict=True):
            assert torch.equal(a[i : i + 1], b)


def test_ref_fused_step_is_the_unfused_sequence():
    y, x, post, comb, fn, base, scale, it, he, ne, pre_in, norm_w = _fused(5, 64, 9)
    new, pre, post2, comb2, xc = href.expand_mix_collapse(y, x, post, comb, fn, base, scale, it, he, ne, pre_in, norm_w)
    want = href.expand(y, x, post, comb)
    assert torch.equal(new, want)
    for got, ref in zip((pre, post2, comb2), href.hc_mixes(want, fn, base, scale, it, he, ne), strict=True):
        assert torch.equal(got, ref)
    assert torch.equal(xc, dref.rms_norm(href.collapse(want, pre_in), norm_w, ne))
    same, *_, none = href.expand_mix_collapse(None, x, None, None, fn, base, scale, it, he, ne)
    assert same is x and none is None


@pytest.mark.parametrize(
    "over",
    [
        {"decode_sk_tok": True},
        {"decode_split": 160, "red": 7, "decode_narrow": True},
        {"decode_sk_tok": True, "decode_split": 160, "red": 160, "decode_narrow": True},
    ],
)
def test_decode_knobs_match_reference_and_keep_rows_batch_invariant(over):
    # per-token Sinkhorn, one-chunk slices (D = 256: 8 slices of 32 channels), slice vectors
    # loaded 7 at a time or all at once: same tolerances as the defaults, a row's bits alone ==
    # in the batch, the counters back at zero
    tuned = _mhc(**over)
    plan = ht.launch_plan(19, 256, tuned.mhc)
    if "decode_split" in over:
        assert (plan["nsl"], plan["ch"]) == (8, 32)
    args = _fused(19, 256, 10)
    batch = ht.expand_mix_collapse(*args, tuned=tuned)
    y, x, post, comb, fn, base, scale, _, _, _, pre_in, norm_w = args
    _assert_fused_close(batch, y, x, post, comb, fn, base, scale, pre_in, norm_w, mixes_of_kernel_streams=True)
    for i in (5, 17):
        one = ht.expand_mix_collapse(
            *(a[i : i + 1] if j in (0, 1, 2, 3, 10) else a for j, a in enumerate(args)), tuned=tuned
        )
        for a, b in zip(batch, one, strict=True):
            assert torch.equal(a[i : i + 1], b)
    assert int(triton_runtime.arrival_counters(torch.device("cpu")).abs().sum()) == 0


def test_decode_block_d_must_divide_the_chunk():
    with pytest.raises(ValueError, match="decode_block_d"):
        ht.launch_plan(1, 256, _mhc(decode_block_d=48).mhc)
