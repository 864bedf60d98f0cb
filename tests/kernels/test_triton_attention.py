"""Fused sparse attention over packed window / compressed records (kernels/attention/triton.py)."""

from __future__ import annotations

import pytest
import torch

from flashpd.kernels.attention import ref as aref
from flashpd.kernels.attention import triton as at
from flashpd.kernels.quant import ref as qref
from flashpd.kernels.rope import ref as rope

H, D, W, K = 4, 64, 8, 6


def _setup(t: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, H, D, generator=g).bfloat16()
    sink = torch.randn(H, generator=g)
    win = qref.pack_window_fp8(torch.randn(16, D, generator=g))
    comp = qref.pack_nvfp4(torch.randn(20, D, generator=g))
    win_rows = torch.randint(-1, 16, (t, W), generator=g)
    comp_rows = torch.randint(-1, 20, (t, K), generator=g)
    pos = torch.randint(0, 1 << 20, (t,), generator=g)
    return q, sink, win, comp, win_rows, comp_rows, pos


def _reference(q, sink, win, comp, win_rows, comp_rows, pos, freqs, unpack=qref.unpack_nvfp4):
    keys = torch.cat(
        (
            qref.unpack_window_fp8(win, torch.bfloat16)[win_rows.clamp_min(0)],
            unpack(comp, torch.bfloat16)[comp_rows.clamp_min(0)],
        ),
        dim=1,
    )
    valid = torch.cat((win_rows >= 0, comp_rows >= 0), dim=1)
    o = aref.sparse_attention(rope.apply_rope(q, pos, freqs), keys, valid, sink, D**-0.5)
    return rope.apply_rope(o, pos, freqs, inverse=True)


def test_packed_attention_with_fused_rope_matches_reference(tune):
    q, sink, win, comp, win_rows, comp_rows, pos = _setup()
    freqs = rope.rope_frequencies(16, 160000.0, rope.Yarn(16, 32, 1, 65536))
    got = tune(at).sparse_attention_packed(
        q, rope.rope_cos_sin(pos, freqs), win, win_rows, comp, comp_rows, sink, D**-0.5
    )
    want = _reference(q, sink, win, comp, win_rows, comp_rows, pos, freqs)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_query_with_no_valid_key_outputs_zero(tune):
    q, sink, win, comp, win_rows, comp_rows, _ = _setup(t=2, seed=1)
    win_rows[1] = -1
    comp_rows[1] = -1
    got = tune(at).sparse_attention_packed(q, None, win, win_rows, comp, comp_rows, sink, D**-0.5)
    assert bool((got[1] == 0).all()) and bool((got[0] != 0).any())


def test_ref_signature_matches_reference(tune):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, H, D, generator=g).bfloat16()
    keys = torch.randn(3, 12, D, generator=g).bfloat16()
    valid = torch.rand(3, 12, generator=g) > 0.3
    sink = torch.randn(H, generator=g)
    torch.testing.assert_close(
        tune(at).sparse_attention(q, keys, valid, sink, 0.125).float(),
        aref.sparse_attention(q, keys, valid, sink, 0.125).float(),
        rtol=2e-2,
        atol=2e-2,
    )


def test_pool_record_width_is_checked(tune):
    q, sink, win, comp, win_rows, comp_rows, _ = _setup()
    with pytest.raises(ValueError, match="record"):
        tune(at).sparse_attention_packed(q, None, win, win_rows, win, comp_rows, sink, 0.1)


def _split_setup(t: int, w: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, H, D, generator=g).bfloat16()
    sink = torch.randn(H, generator=g)
    win = qref.pack_window_fp8(torch.randn(3 * w, D, generator=g))
    comp = qref.pack_nvfp4(torch.randn(64, D, generator=g))
    win_rows = torch.randint(-1, 3 * w, (t, w), generator=g)
    comp_rows = torch.randint(-1, 64, (t, k), generator=g)
    comp_rows[0] = -1  # a query whose compressed ranges are all empty
    win_rows[1, :] = -1  # and one whose window ranges are
    pos = torch.randint(0, 1 << 20, (t,), generator=g)
    return q, sink, win, comp, win_rows, comp_rows, pos


@pytest.mark.parametrize("min_tiles", [1, 2, 3])
def test_split_kv_matches_single_pass_and_reference(tune, monkeypatch, min_tiles):
    q, sink, win, comp, win_rows, comp_rows, pos = _split_setup(3, 40, 50, seed=3)
    freqs = rope.rope_frequencies(16, 160000.0, rope.Yarn(16, 32, 1, 65536))
    tables = rope.rope_cos_sin(pos, freqs)
    tune.set("attention", legacy_max_q=1 << 20)  # the per-head-block kernels
    tune.set("attention", split_target=0)
    single = tune(at).sparse_attention_packed(q, tables, win, win_rows, comp, comp_rows, sink, D**-0.5)
    tune.set("attention", split_target=10_000)
    tune.set("attention", split_min_tiles=min_tiles)
    tune.set("attention", split_min_splits=2)
    splits, per = at.split_plan(3, H, (40, 50), tune.attention)
    assert splits > 1 and (splits - 1) * per < 7 <= splits * per  # 3 window + 4 comp. tiles
    got = tune(at).sparse_attention_packed(q, tables, win, win_rows, comp, comp_rows, sink, D**-0.5)
    want = _reference(q, sink, win, comp, win_rows, comp_rows, pos, freqs)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), single.float(), rtol=1e-2, atol=1e-2)


def test_split_kv_query_with_no_valid_key_outputs_zero(tune, monkeypatch):
    q, sink, win, comp, win_rows, comp_rows, _ = _split_setup(2, 40, 50, seed=4)
    win_rows[1] = -1
    comp_rows[1] = -1
    tune.set("attention", legacy_max_q=1 << 20)
    tune.set("attention", split_min_tiles=1)
    assert at.split_plan(2, H, (40, 50), tune.attention)[0] > 1
    got = tune(at).sparse_attention_packed(q, None, win, win_rows, comp, comp_rows, sink, D**-0.5)
    assert bool((got[1] == 0).all()) and bool((got[0] != 0).any())


def test_split_plan_leaves_full_grids_alone(tune):
    assert at.split_plan(tune.attention.split_max_q + 1, 64, (128, 512), tune.attention) == (1, 0)
    splits, per = at.split_plan(1, 64, (128, 512), tune.attention)
    assert splits > 1 and splits * per >= 128 // 16 + 512 // 16


def test_warmup_runs_every_row_count_topk_and_a_single_pass_chunk(tune, monkeypatch):
    tune.set("attention", legacy_max_q=0)
    tune.set("attention", heads_split_target=4)
    single = at.single_pass_rows(H, tune.attention)
    assert single == 4 and at.heads_plan(single, H, (W, K), tune.attention)[1] == 1  # the prefill variant
    assert at.heads_plan(2, H, (W, K), tune.attention)[1] > 1  # the decode rows split
    assert tune(at).warmup(H, D, 8, W, (0, K, K), rows=(1, 2)) == 6


# ---------------------------------------------------------------- heads-as-M kernel
@pytest.fixture(autouse=True)
def _heads_for_small_batches(tune, monkeypatch, request):
    """The heads-as-M tests run it at any batch size (by default tiny batches take the
    per-head-block kernels)."""
    if "heads" in request.node.name:
        tune.set("attention", legacy_max_q=0)


@pytest.mark.parametrize(
    "block_n,prefetch,tau,comp_fp8,trans,vsplit",
    [
        (16, False, 0.0, False, False, False),
        (16, True, 8.0, False, False, False),
        (64, True, 0.0, True, False, False),
        (32, False, 0.0, True, True, False),
        (16, False, 0.0, False, False, True),
        (32, False, 0.0, True, False, True),
    ],
)
def test_heads_kernel_single_pass_matches_reference(tune, monkeypatch, block_n, prefetch, tau, comp_fp8, trans, vsplit):
    """All heads in one program, several key tiles (the last ones partial), empty slots, a
    query with no compressed key and one with no window key; NVFP4 or FP8 compressed records;
    lazy rescaling (tau > 0) gives the same softmax, and so do transposed scores (trans) and
    two programs per query each owning half of the output channels (vsplit)."""
    tune.set("attention", heads_trans_s=trans)
    tune.set("attention", heads_vsplit=vsplit)
    tune.set("attention", heads_vsplit_block_n=block_n)
    tune.set("attention", heads_split_target=0)
    tune.set("attention", heads_rescale_tau=tau)
    tune.set("attention", heads_block_n=block_n)
    tune.set("attention", heads_prefetch=prefetch)
    q, sink, win, comp, win_rows, comp_rows, pos = _split_setup(3, 40, 50, seed=5)
    q = q * 4  # scores spread over several units: the running max moves between tiles
    fmt, unpack = at.FMT_NVFP4, qref.unpack_nvfp4
    if comp_fp8:
        comp = qref.pack_window_fp8(qref.unpack_nvfp4(comp, torch.float32))
        fmt, unpack = at.FMT_FP8, qref.unpack_window_fp8
    assert at.heads_plan(3, H, (40, 50), tune.attention) == (block_n, 1, 1 << 20)
    freqs = rope.rope_frequencies(16, 160000.0, rope.Yarn(16, 32, 1, 65536))
    got = tune(at).sparse_attention_packed(
        q, rope.rope_cos_sin(pos, freqs), win, win_rows, comp, comp_rows, sink, D**-0.5, comp_format=fmt
    )
    want = _reference(q, sink, win, comp, win_rows, comp_rows, pos, freqs, unpack)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("target,trans", [(9, False), (10_000, False), (9, True)])
def test_heads_split_kv_matches_single_pass(tune, monkeypatch, target, trans):
    tune.set("attention", heads_trans_s=trans)
    q, sink, win, comp, win_rows, comp_rows, pos = _split_setup(3, 40, 50, seed=6)
    freqs = rope.rope_frequencies(16, 160000.0, rope.Yarn(16, 32, 1, 65536))
    tables = rope.rope_cos_sin(pos, freqs)
    tune.set("attention", heads_block_n=16)
    tune.set("attention", heads_split_target=0)
    single = tune(at).sparse_attention_packed(q, tables, win, win_rows, comp, comp_rows, sink, D**-0.5)
    tune.set("attention", heads_split_target=target)
    tune.set("attention", heads_split_block_n=16)
    bn, splits, per = at.heads_plan(3, H, (40, 50), tune.attention)
    assert bn == 16 and splits > 1 and (splits - 1) * per < 7 <= splits * per
    got = tune(at).sparse_attention_packed(q, tables, win, win_rows, comp, comp_rows, sink, D**-0.5)
    torch.testing.assert_close(got.float(), single.float(), rtol=1e-2, atol=1e-2)
    want = _reference(q, sink, win, comp, win_rows, comp_rows, pos, freqs)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("target", [0, 10_000])
def test_heads_query_with_no_valid_key_outputs_zero(tune, monkeypatch, target):
    tune.set("attention", heads_split_target=target)
    tune.set("attention", heads_block_n=16)
    tune.set("attention", heads_split_block_n=16)
    q, sink, win, comp, win_rows, comp_rows, _ = _split_setup(2, 40, 50, seed=7)
    win_rows[1] = -1
    comp_rows[1] = -1
    got = tune(at).sparse_attention_packed(q, None, win, win_rows, comp, comp_rows, sink, D**-0.5)
    assert bool((got[1] == 0).all()) and bool((got[0] != 0).any())


def test_heads_plan_runs_prefill_chunks_in_one_pass(tune, monkeypatch):
    tune.set("attention", heads_split_target=132)
    target = 132
    assert at.heads_plan(4096, 64, (128, 512), tune.attention)[1:] == (1, 1 << 20)
    bn, splits, per = at.heads_plan(64, 64, (128, 512), tune.attention)
    assert splits * 64 >= min(target, 64 * (128 // bn + 512 // bn)) and splits * per >= 640 // bn


# ---------------------------------------------------------------- fused split-KV combine
class _NoCombine:
    """Stands in for _attn_combine_kernel where the fused path must not launch it."""

    def __getitem__(self, grid):
        raise AssertionError("fused_combine launched _attn_combine_kernel")


def _counters_zero() -> bool:
    from flashpd.kernels import triton_runtime

    return not bool(triton_runtime.arrival_counters(torch.device("cpu")).any())


@pytest.mark.parametrize("t,kernel,min_tiles", [(1, "legacy", 1), (3, "legacy", 2), (1, "heads", 1), (3, "heads", 1)])
def test_fused_combine_is_bit_identical_to_the_combine_kernel(tune, monkeypatch, t, kernel, min_tiles):
    """fused_combine: the last split program of each (query, head block) combines, in one
    launch: the same bits as the split + combine launches, within the reference's tolerance,
    and every arrival counter back at zero (the next launch starts from them)."""
    q, sink, win, comp, win_rows, comp_rows, pos = _split_setup(max(t, 2), 40, 50, seed=8)
    q, win_rows, comp_rows, pos = q[:t], win_rows[:t], comp_rows[:t], pos[:t]
    q = q * 4  # the partials' maxima differ between ranges
    tables = rope.rope_cos_sin(pos, rope.rope_frequencies(16, 160000.0, rope.Yarn(16, 32, 1, 65536)))
    if kernel == "legacy":
        tune.set("attention", legacy_max_q=1 << 20)
        tune.set("attention", split_target=10_000)
        tune.set("attention", split_min_tiles=min_tiles)
        tune.set("attention", split_min_splits=2)
        tune.set("attention", split_heads=4)
        tune.set("attention", combine_heads=2)  # two combine chunks per program
        assert at.split_plan(t, H, (40, 50), tune.attention)[0] > 2
    else:
        tune.set("attention", legacy_max_q=0)
        tune.set("attention", heads_split_target=10_000)
        tune.set("attention", heads_split_block_n=16)
        tune.set("attention", combine_heads=4)
        assert at.heads_plan(t, H, (40, 50), tune.attention)[1] > 2
    assert _counters_zero()
    args = (q, tables, win, win_rows, comp, comp_rows, sink, D**-0.5)
    tune.set("attention", fused_combine=False)
    unfused = tune(at).sparse_attention_packed(*args)
    tune.set("attention", fused_combine=True)
    monkeypatch.setattr(at, "_attn_combine_kernel", _NoCombine())
    fused = tune(at).sparse_attention_packed(*args)
    assert _counters_zero()
    assert torch.equal(fused, unfused)
    want = _reference(
        q, sink, win, comp, win_rows, comp_rows, pos, rope.rope_frequencies(16, 160000.0, rope.Yarn(16, 32, 1, 65536))
    )
    torch.testing.assert_close(fused.float(), want.float(), rtol=2e-2, atol=2e-2)
    again = tune(at).sparse_attention_packed(*args)  # the counters serve the next launch too
    assert torch.equal(again, fused) and _counters_zero()
