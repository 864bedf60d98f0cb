"""Torch ops (kernel launches besides the Triton kernels) inside `Model.compute`, on the CPU.

    python benchmarks/glue_count.py [--prompt 40] [--out counts.json]

The GPU path (`GpuModel`, Triton kernels under the interpreter) over a checkpoint with the
`bench` preset's layer structure (40 layers, the same compress ratios, KV / index / candidate
sources, Engram layers, top-6 routing) at tiny widths, one prompt then one decode step. Every
aten op dispatched inside `compute` that would launch a device kernel (views, allocations and
host scalars excluded; ops inside the interpreter excluded) is counted by the innermost flashpd
function that called it. Launch counts do not depend on the widths, so this is the per-step
torch-op count of the bench decode step (graphed or eager), without a GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import tempfile
import traceback

import torch

# isort: off
from flashpd.kernels import triton_runtime  # noqa: F401  (before any kernel import)

# isort: on
from torch.utils._python_dispatch import TorchDispatchMode

from flashpd.engine.gpu.loading import load_gpu_model
from flashpd.engine.kv_pools import KVPools, PagedSeqState
from flashpd.model.checkpoint import write_random_checkpoint
from flashpd.model.model import LogitsRequest, SeqInput, SeqPlan
from flashpd.model.presets import preset_config, tokenizer_path

NO_KERNEL = frozenset(
    "view unsqueeze slice select expand empty empty_like empty_strided new_empty lift_fresh "
    "_local_scalar_dense detach alias t transpose permute squeeze _unsafe_view as_strided "
    "_reshape_alias reshape split unbind scalar_tensor split_with_sizes unflatten flatten set_ "
    "resize_ result_type is_nonzero".split()
)


class OpCounter(TorchDispatchMode):
    """(op, innermost flashpd function) -> launches, for ops under `compute`."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL:
            stack = traceback.extract_stack()[:-1]
            if any(f.name == "compute" for f in stack) and not any("triton/runtime" in f.filename for f in stack):
                ours = [
                    f
                    for f in stack
                    if "/.venv/" not in f.filename
                    and "site-packages" not in f.filename
                    and not f.filename.endswith("glue_count.py")
                ]
                where = "?"
                if ours:
                    f = ours[-1]
                    where = f"{_rel(f.filename)}:{f.name}"
                self.counts[(name, where)] += 1
        return func(*args, **(kwargs or {}))


def _rel(path: str) -> str:
    for marker in ("flashpd/", "/main/"):
        if marker in path:
            return path.split(marker)[-1]
    return path


def bench_shaped_config():
    """The bench preset's layer structure at tiny widths (the tiny preset's Engram tables)."""
    base, tiny = preset_config("bench"), preset_config("tiny")
    return base.replace(
        name="benchshape",
        vocab_size=tiny.vocab_size,
        hidden_size=128,
        num_heads=4,
        head_dim=64,
        rope_head_dim=16,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=32,
        sliding_window=8,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=8,
        candidate_topk_blocks=2,
        candidate_block_size=4,
        n_routed_experts=8,
        num_experts_per_tok=base.num_experts_per_tok,
        moe_intermediate_size=32,
        hc_sinkhorn_iters=1,
        engram_num_embeddings=tiny.engram_num_embeddings,
        engram_n_heads=tiny.engram_n_heads,
        engram_head_dim=tiny.engram_head_dim,
        engram_vocab_size=tiny.engram_vocab_size,
        engram_compressed_vocab_size=tiny.engram_compressed_vocab_size,
        engram_pad_token_id=tiny.engram_pad_token_id,
        image_token_id=None,
        max_position_embeddings=65536,
        rope=tiny.rope,
    )


def count(prompt_len: int) -> dict[str, collections.Counter]:
    cfg = bench_shaped_config()
    with tempfile.TemporaryDirectory() as path:
        write_random_checkpoint(cfg, path, seed=3)
        shutil.copyfile(tokenizer_path("tiny"), os.path.join(path, "tokenizer.json"))
        model = load_gpu_model(path, "cpu")
    model.graphs = None
    pools = KVPools(cfg, 8, 2, "cpu", window_scratch_rows=max(64, prompt_len))
    state = PagedSeqState(pools, 0, list(range(8)), torch.bfloat16)
    prompt = torch.randint(5, 200, (prompt_len,), generator=torch.Generator().manual_seed(1))
    out = {}
    counter = OpCounter()
    with counter:
        logits = model.forward(prompt, [SeqInput(state, 0, prompt_len, SeqPlan(logits=LogitsRequest.ALL))])[0]
    out["prefill"], counter.counts = counter.counts, collections.Counter()
    with counter:
        model.forward(torch.tensor([int(logits[-1].argmax())]), [SeqInput(state, prompt_len, 1)])
    out["decode"] = counter.counts
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    counts = count(args.prompt)
    for kind, c in counts.items():
        by_site: collections.Counter = collections.Counter()
        for (_, where), n in c.items():
            by_site[where] += n
        print(f"## {kind}: {sum(c.values())} torch-op launches in compute")
        for where, n in by_site.most_common():
            print(f"{n:6d}  {where}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({k: [[op, w, n] for (op, w), n in c.items()] for k, c in counts.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
