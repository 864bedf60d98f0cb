"""Decode indexer at bench-preset shapes: paged scoring + top-k, small-batch forms on vs off.

    python benchmarks/indexer_bench.py --out DIR [--batch 1 8 64] [--context 8192] [--smoke]

For each batch B (one query per sequence, every sequence at `--context` tokens) and each kind of
index layer of the preset at that context:
  dense  (ratio 2 / 1 index sources): index_scores_paged + select_topk over n entries
  sparse (reindex layers):            index_topk_sparse_paged over candidate_topk_blocks blocks
the median us per call over CUDA-graph replays with the indexer's small-batch launches
(configs.IndexerConfig) off (score_target 0, topk_split_q 0: the previous launches) and on (the defaults), and whether
both select the same pool rows. Rows go to DIR/indexer_bench.json, a table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from flashpd.bench import kernel_roofline
from flashpd.bench.kernel_roofline import graph_ms
from flashpd.kernels import configs
from flashpd.kernels.indexer import triton as it
from flashpd.kernels.quant import ref as qref
from flashpd.model.presets import preset_config

OFF = configs.override(configs.DEFAULT, indexer={"score_target": 0, "topk_split_q": 0})
DEV = "cuda"


def _case(cfg, batch: int, n: int, sparse: bool, gen: torch.Generator):
    nh, di, k = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    q = qref.fake_quant_mxfp4(torch.randn(batch, nh, di, generator=gen)).bfloat16().to(DEV)
    w = torch.randn(batch, nh, generator=gen).bfloat16().to(DEV)
    pool = qref.pack_mxfp4(torch.randn(batch * n, di, generator=gen)).to(DEV)
    key_rows = torch.randperm(batch * n, generator=gen).reshape(batch, n).int().to(DEV)
    seq_of = torch.arange(batch, dtype=torch.int32, device=DEV)
    n_vis = torch.full((batch,), n, dtype=torch.int32, device=DEV)
    if not sparse:

        def run(tuned):
            s = it.index_scores_paged(q, w, pool, key_rows, seq_of, n_vis, weight_scale=0.01, tuned=tuned)
            return it.select_topk(s, k, pool_rows=(key_rows, seq_of), tuned=tuned)

        return run
    bs, nb = cfg.candidate_block_size, cfg.candidate_topk_blocks
    wide = max(n, nb * bs + bs)  # the pool's key-row width exceeds the kept blocks' columns
    key_rows = torch.cat([key_rows, torch.full((batch, wide - n), -1, dtype=torch.int32, device=DEV)], dim=1)
    real = -(-n // bs)
    blocks = torch.full((batch, nb), -1, dtype=torch.int64)
    for b in range(batch):
        kept = torch.randperm(real, generator=gen)[: min(nb, real)].sort().values
        blocks[b, : kept.numel()] = kept
    blocks = blocks.to(DEV)

    def run(tuned):
        return it.index_topk_sparse_paged(
            q, w, pool, key_rows, seq_of, n_vis, blocks, bs, k, weight_scale=0.01, as_pool_rows=True, tuned=tuned
        )

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 8, 64])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (interpreter)")
    args = ap.parse_args()
    global DEV
    DEV = kernel_roofline.DEV = "cpu" if args.smoke else "cuda"
    cfg = preset_config("small" if args.smoke else "bench")
    ratios = sorted({cfg.compress_ratios[i] for i in cfg.index_source_layer_ids})
    cases = [(f"dense r{r}", args.context // r, False) for r in ratios]
    cases.append((f"sparse r{ratios[0]}", args.context // ratios[0], True))
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in args.batch:
        for name, n, sparse in cases:
            run = _case(cfg, batch, n, sparse, gen)
            row = {"batch": batch, "case": name, "entries": n}
            for label, tuned in (("off", OFF), ("on", configs.DEFAULT)):
                row[f"{label}_out"] = run(tuned)
                row[f"{label}_us"] = 1e3 * graph_ms([lambda t=tuned, run=run: run(t)], reps=1 if args.smoke else 9)
            row["same"] = bool(torch.equal(row.pop("off_out"), row.pop("on_out")))
            row["tiles_on"] = it.score_tiles(batch, n, configs.DEFAULT.indexer)
            row["topk_slice_on"] = it.topk_slice(batch, n, cfg.index_topk, configs.DEFAULT.indexer)
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = ["| B | case | entries | off us | on us | same |", "|---|---|---|---|---|---|"]
    lines += [
        f"| {r['batch']} | {r['case']} | {r['entries']} | {r['off_us']:.1f} | {r['on_us']:.1f} | {r['same']} |"
        for r in rows
    ]
    print("\n".join(lines))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "indexer_bench.json"), "w") as f:
        json.dump(
            {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "context": args.context, "rows": rows},
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
