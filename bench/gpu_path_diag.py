"""Which kernel path moves the GPU forward away from the reference on the smoke model?

    python -m flashpd.bench.gpu_path_diag [--tests DIR]

Runs tests/engine/gpu/test_gpu_forward.py's chunked-prefill comparison (19 + 10 prompt rows,
every row's logits) once per variant of the kernel switches and prints the median row error
against the reference (the test's bound on the GPU: 0.1). Variants: base; MXFP4 dense GEMMs
through the register-dequant path instead of tl.dot_scaled; routed GEMV off; packed attention
through the per-head-block kernels; all three.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tests", default=os.path.join(os.getcwd(), "tests/engine/gpu"))
    args = ap.parse_args(argv)
    sys.path.insert(0, args.tests)
    import shutil
    import tempfile

    import test_gpu_forward as t  # noqa: E402

    from flashpd.engine.gpu import forward as fw
    from flashpd.engine.gpu.loading import load_gpu_model
    from flashpd.kernels import dispatch
    from flashpd.kernels.attention import triton as at
    from flashpd.kernels.dense import triton as dt
    from flashpd.kernels.moe import triton as mt
    from flashpd.model.checkpoint import load_checkpoint, write_random_checkpoint
    from flashpd.model.model import Model
    from flashpd.model.presets import tokenizer_path

    fw.PREFILL_WARMUP_ROWS = 0

    path = tempfile.mkdtemp(prefix="smoke_ckpt")  # the test's `models` fixture
    write_random_checkpoint(t.smoke_config(), path, seed=11)
    shutil.copyfile(tokenizer_path("tiny"), os.path.join(path, "tokenizer.json"))
    kernels = {op: "triton" for op in dispatch.OPS if "triton" in dispatch.available(op)}
    ref = Model.from_checkpoint(load_checkpoint(path, t.DEVICE), t.torch.bfloat16, kernels)
    gpu = load_gpu_model(path, t.DEVICE)
    base = (dict(dt.CONFIG), mt.GEMV, at.CONFIG["legacy_max_q"])

    attn_base = dict(at.CONFIG)

    def setv(mx=None, gemv=None, legacy=None, asm=None, tau=None):
        dt.CONFIG.update(base[0])
        at.CONFIG.update(attn_base)
        mt.GEMV, at.CONFIG["legacy_max_q"] = base[1], base[2]
        if asm is not None:
            at.CONFIG["heads_asm"] = asm
        if tau is not None:
            at.CONFIG["heads_rescale_tau"] = tau
        if mx:
            dt.CONFIG["mxfp4_decode"] = dt.CONFIG["mxfp4_large"] = mx
        if gemv is not None:
            mt.GEMV = gemv
        if legacy:
            at.CONFIG["legacy_max_q"] = legacy

    variants = {"base": {}, "mx_asm": {"mx": "asm"}, "no_gemv": {"gemv": False},
                "legacy_attn": {"legacy": 1 << 30}, "heads_no_asm": {"asm": False},
                "heads_tau0": {"tau": 0.0},
                "all_off": {"mx": "asm", "gemv": False, "legacy": 1 << 30}}
    for name, kw in variants.items():
        setv(**kw)
        pair = t.Pair(ref, gpu)
        seq = pair.states(0, [0, 1, 2])
        prompt = t._prompt(29, 1)
        plan = t.SeqPlan(logits=t.LogitsRequest.ALL)
        errs = []
        for ids, start in ((prompt[:19], 0), (prompt[19:], 19)):
            r, g = pair.run([ids], [seq], [start], [plan])
            rf, gf = r[0].float().cpu(), g[0].float().cpu()
            errs.append(float(((rf - gf).abs().amax(-1) / rf.abs().amax(-1)).median()))
        print(f"{name:12s} median row error chunk1 {errs[0]:.3f} chunk2 {errs[1]:.3f}",
              flush=True)
    setv()
    # in context: each attention call of chunk 1 through the heads kernel vs the per-head-block
    # kernels (max row error between the two; BF16 noise is ~1e-2)
    orig = at.sparse_attention_packed

    def both(q, rope, win, win_rows, comp, comp_rows, sink, scale, comp_format=at.FMT_NVFP4):
        at.CONFIG["legacy_max_q"] = 1 << 30
        a = orig(q, rope, win, win_rows, comp, comp_rows, sink, scale, comp_format=comp_format)
        at.CONFIG["legacy_max_q"] = base[2]
        b = orig(q, rope, win, win_rows, comp, comp_rows, sink, scale, comp_format=comp_format)
        af = a.float()
        e = (af - b.float()).abs().amax(-1) / af.abs().amax(-1).clamp_min(1e-30)
        print(f"attention call T={q.shape[0]}: heads vs per-head-block max row error "
              f"{float(e.max()):.4f}", flush=True)
        return b

    gpu.attention.sparse_attention_packed = both
    pair = t.Pair(ref, gpu)
    seq = pair.states(0, [0, 1, 2])
    pair.run([t._prompt(29, 1)[:19]], [seq], [0], [t.SeqPlan(logits=t.LogitsRequest.ALL)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
