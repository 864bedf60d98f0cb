"""The quality driver on the random tiny checkpoint: every comparison runs and is reported."""

from __future__ import annotations

import math

import pytest
import torch

from flashpd.bench import quality as q


def _seq(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(5, 500, (n - 1,), generator=g).tolist()


def test_paired_statistics():
    p = q.Paired("x")
    for r, v in ((1.0, 1.1), (2.0, 2.3), (3.0, 3.2)):
        p.add(r, v)
    s = p.summary()
    assert s["delta"] == pytest.approx(0.2)
    assert s["se_metric"] == pytest.approx(1.0 / math.sqrt(3))
    assert s["se_delta"] == pytest.approx(0.1 / math.sqrt(3))
    assert s["within"] is True  # 0.2 <= 1.5 * 0.577
    assert q.agreement([1, 2, 3, 4], [1, 2, 0, 4]) == 0.75
    assert q.agreement([1, 2], [1, 2, 3]) == pytest.approx(2 / 3)


def test_bf16_kv_quant_rounds_to_bf16_only():
    impl = q.register_bf16_kv_quant()
    from flashpd.kernels import dispatch

    mod = dispatch.get("quant", impl)
    x = torch.randn(4, 64)
    assert torch.equal(mod.fake_quant_mxfp4(x), x.to(torch.bfloat16).float())
    assert torch.equal(mod.fake_quant_bf16(x), x.to(torch.bfloat16).float())
    from flashpd.kernels.quant import ref

    assert torch.equal(mod.fake_quant_fp8_ue8m0(x), ref.fake_quant_fp8_ue8m0(x))  # window stays


def test_driver_runs_every_comparison_on_tiny(ckpt_dir):
    seqs = [_seq(320, 1), _seq(320, 2)]
    tf = q.teacher_forced(ckpt_dir, seqs, (256,), lambda _m: None)
    assert tf["tokens"] == 2 * 319
    assert all(math.isfinite(v) and v > 1 for v in tf["ppl"].values())
    assert tf["ppl"]["nvfp4"] != tf["ppl"]["bf16"]  # the format switch reaches the forward
    for s in tf["formats"] + tf["replay"]:
        assert s["n"] == 2 and math.isfinite(s["delta"])
    for s in tf["formats_agreement"] + tf["replay_agreement"]:
        assert 0.0 <= s["var"] <= 1.0
    gen = q.generated(ckpt_dir, seqs[:1], (256,), 4, lambda _m: None)
    for s in tf["colocated"] + tf["pd_vs_colocated"]:
        assert s["n"] == 2 and math.isfinite(s["delta"])
    for key in ("colocated_hit", "decode_side", "pd_vs_colocated"):
        assert gen[key][0]["n"] == 1 and 0.0 <= gen[key][0]["var"] <= 1.0
    text = q.render(
        {
            "teacher_forced": tf,
            "generated": gen,
            "meta": {"command": "cmd", "checkpoint": "ck", "seq_len": 320, "gen_tokens": 4, "seconds": 1.0},
        }
    )
    assert "Compressed-KV formats" in text and "Bounded replay" in text
    assert "Disaggregated" in text and text.count("within 1.5 SE") >= 7
