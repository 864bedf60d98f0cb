"""Which slice of every checkpoint tensor a rank holds, on the raw released format.

The rules are data (`TP_RULES`), matched against the tensor name without its `layers.N.` prefix:

    column   split dim 0 (output rows) under TP        wq_b (heads), attn_sink (heads),
                                                       wo_a (output groups), shared/routed w1, w3
    row      split dim 1 (input columns) under TP;     wo_b, shared/routed w2
             the partial products need an all-reduce
    vocab    split dim 0 under a vocab-parallel head,  head.weight
             else replicated
    repl.    every rank holds it whole                 the shared KV latent (wkv, kv_norm), wq_a,
                                                       compressor, indexer, norms, mHC, router
                                                       gate, embed, Engram

Routed experts (`ffn.experts.E.*`) are held only by their EP owner (`ParallelPlan.owned_experts`);
under TP they are split like the shared expert.

Splits act on the stored bytes, scales included, and must fall on block boundaries so that
dequantise(shard) == shard(dequantise) exactly:

    FP8 weight [out, in] + tile scale [out/32, in/32]     split rows/cols in multiples of 32;
                                                          the scale splits by tiles
    MXFP4 packed [out, in/2] + scale [out, in/32]         split along K in multiples of 32
                                                          elements = 16 bytes; scale by blocks
"""

from __future__ import annotations

import enum
import functools
import json
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open

from flashpd.engine.parallel.plan import MXFP4_K_BLOCK, ParallelPlan
from flashpd.kernels.quant import ref as quant
from flashpd.model.checkpoint import IGNORED_PREFIXES, INDEX_FILE, LOADED_TORCH_DTYPES, TensorSpec, manifest
from flashpd.model.config import ModelConfig

FP8_BLOCK = (32, 32)


class ShardError(ValueError):
    """A tensor cannot be split as asked, or a checkpoint lacks what a rank needs."""


class Split(enum.Enum):
    REPLICATED = "replicated"
    COLUMN = "column"  # dim 0
    ROW = "row"  # dim 1
    VOCAB = "vocab"  # dim 0 when plan.vocab_parallel_head, else replicated


_W = r"\.(weight|scale)"  # a quantised weight and its scale follow the same rule
TP_RULES: tuple[tuple[str, Split], ...] = (
    (r"embed\.weight", Split.REPLICATED),
    (r"norm\.weight", Split.REPLICATED),
    (r"head\.weight", Split.VOCAB),
    (r"(attn|ffn)_norm\.weight", Split.REPLICATED),
    (r"hc_(attn|ffn)_(fn|base|scale)", Split.REPLICATED),
    (r"attn\.wq_a" + _W, Split.REPLICATED),
    (r"attn\.q_norm\.weight", Split.REPLICATED),
    (r"attn\.wq_b" + _W, Split.COLUMN),
    (r"attn\.wkv" + _W, Split.REPLICATED),
    (r"attn\.kv_norm\.weight", Split.REPLICATED),
    (r"attn\.wo_a" + _W, Split.COLUMN),
    (r"attn\.wo_b" + _W, Split.ROW),
    (r"attn\.attn_sink", Split.COLUMN),
    (r"attn\.compressor\.(wkv|wgate|norm)\.weight", Split.REPLICATED),
    (r"attn\.indexer\.(wk|k_norm|weights_proj)\.weight", Split.REPLICATED),
    (r"attn\.indexer\.wq_b" + _W, Split.REPLICATED),
    (r"ffn\.gate\.(weight|bias|bias_vl)", Split.REPLICATED),
    (r"ffn\.shared_experts\.w[13]" + _W, Split.COLUMN),
    (r"ffn\.shared_experts\.w2" + _W, Split.ROW),
    (r"ffn\.experts\.\d+\.w[13]" + _W, Split.COLUMN),
    (r"ffn\.experts\.\d+\.w2" + _W, Split.ROW),
    (r"engram\.(embed|wkv)" + _W, Split.REPLICATED),
    (r"engram\.[qk]_weight", Split.REPLICATED),
)
_COMPILED = tuple((re.compile(p), s) for p, s in TP_RULES)
_LAYER_PREFIX = re.compile(r"layers\.\d+\.")
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.")


@dataclass(frozen=True)
class TensorRule:
    split: Split
    expert_id: int | None  # routed expert: only its EP owner holds it


@dataclass(frozen=True)
class Slice:
    """The part of a stored tensor one rank holds: [start, stop) of `dim` (None = whole)."""

    dim: int | None
    start: int = 0
    stop: int = 0


def _leaf(name: str) -> str:
    match = _LAYER_PREFIX.match(name)
    return name[match.end() :] if match else name


def tensor_rule(name: str) -> TensorRule:
    """The TP split and expert ownership of a checkpoint tensor; unknown names raise."""
    rule = _leaf_rule(_leaf(name))
    if rule is None:
        raise ShardError(f"no sharding rule for checkpoint tensor {name!r}")
    return rule


@functools.lru_cache(maxsize=4096)  # leaves repeat across layers; the released model has 93K names
def _leaf_rule(leaf: str) -> TensorRule | None:
    for pattern, split in _COMPILED:
        if pattern.fullmatch(leaf):
            expert = _EXPERT.match(leaf)
            return TensorRule(split, int(expert.group(1)) if expert else None)
    return None


def holds(name: str, cfg: ModelConfig, plan: ParallelPlan, rank: int) -> bool:
    """Whether `rank` holds any part of tensor `name` (False only for other ranks' experts)."""
    rule = tensor_rule(name)
    plan.check_rank(rank)
    return rule.expert_id is None or rule.expert_id in plan.owned_experts(cfg, rank)


# ============================================================================ slicing
def _split_dim(split: Split, plan: ParallelPlan) -> int | None:
    if plan.tp_size == 1 or split is Split.REPLICATED:
        return None
    if split is Split.VOCAB:
        return 0 if plan.vocab_parallel_head else None
    return 0 if split is Split.COLUMN else 1


def _unit(dtype: str, dim: int, block: tuple[int, int]) -> int:
    """Granularity (in stored elements) a split of `dim` must respect."""
    if dtype == "F8_E4M3":  # FP8 weight: whole 32x32 tiles (its E8M0 scale splits by tile)
        return block[dim]
    if dtype == "I8" and dim == 1:  # MXFP4 packed along K: 32 elements = 16 bytes
        return MXFP4_K_BLOCK // 2
    return 1  # scales (one entry per tile / block), plain tensors, MXFP4 rows


def tensor_slice(
    name: str, spec: TensorSpec, plan: ParallelPlan, rank: int, block: tuple[int, int] = FP8_BLOCK
) -> Slice:
    """The slice of stored tensor `name` (dtype and shape in `spec`) that `rank` holds."""
    dim = _split_dim(tensor_rule(name).split, plan)
    if dim is None:
        plan.check_rank(rank)
        return Slice(None)
    if dim >= len(spec.shape):
        raise ShardError(f"{name}: {len(spec.shape)}-D tensor has no dim {dim} to split")
    size, tp = spec.shape[dim], plan.tp_size
    if size % tp:
        raise ShardError(f"{name}: dim {dim} of size {size} is not divisible by tp_size={tp}")
    part, unit = size // tp, _unit(spec.dtype, dim, block)
    if part % unit:
        raise ShardError(
            f"{name}: a split of dim {dim} into {tp} parts of {part} falls inside a {unit}-element quantisation block"
        )
    start = plan.tp_rank(rank) * part
    return Slice(dim, start, start + part)


def shard_spec(
    name: str, spec: TensorSpec, plan: ParallelPlan, rank: int, block: tuple[int, int] = FP8_BLOCK
) -> TensorSpec:
    """The stored spec of `rank`'s part (no ownership check: see `holds`)."""
    sl = tensor_slice(name, spec, plan, rank, block)
    if sl.dim is None:
        return spec
    shape = list(spec.shape)
    shape[sl.dim] = sl.stop - sl.start
    return TensorSpec(spec.dtype, tuple(shape))


_TORCH_TO_STORED = {torch.float8_e4m3fn: "F8_E4M3", torch.bfloat16: "BF16", torch.float32: "F32"}


def _stored_dtype(name: str, tensor: torch.Tensor) -> str:
    """Safetensors dtype of a tensor in loaded form (uint8 = E8M0 scale or packed MXFP4)."""
    if tensor.dtype == torch.uint8:
        return "F8_E8M0" if name.endswith(".scale") else "I8"
    if tensor.dtype not in _TORCH_TO_STORED:
        raise ShardError(f"{name}: dtype {tensor.dtype} is not a checkpoint dtype")
    return _TORCH_TO_STORED[tensor.dtype]


def shard_tensor(
    name: str, tensor: torch.Tensor, plan: ParallelPlan, rank: int, block: tuple[int, int] = FP8_BLOCK
) -> torch.Tensor:
    """`rank`'s part of a raw (loaded-form) checkpoint tensor; a contiguous copy when split."""
    spec = TensorSpec(_stored_dtype(name, tensor), tuple(tensor.shape))
    sl = tensor_slice(name, spec, plan, rank, block)
    if sl.dim is None:
        return tensor
    return tensor.narrow(sl.dim, sl.start, sl.stop - sl.start).contiguous()


# ============================================================================ loading
@dataclass(frozen=True)
class RankShard:
    """The raw checkpoint tensors one rank holds (loaded form, see model/checkpoint.py)."""

    cfg: ModelConfig
    plan: ParallelPlan
    rank: int
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ShardError(f"rank {self.rank} of plan {self.plan.name} holds no {name!r}")
        return self.tensors[name]

    def fp8(self, prefix: str, dtype: torch.dtype) -> torch.Tensor:
        """`prefix.weight` E4M3 + `prefix.scale` tiles -> the rank's part in `dtype`."""
        return quant.dequantize_fp8_blockwise(
            self.get(f"{prefix}.weight"), self.get(f"{prefix}.scale"), dtype, self.cfg.weight_block_size
        )

    def mxfp4(self, prefix: str, dtype: torch.dtype) -> torch.Tensor:
        return quant.dequantize_mxfp4_weight(self.get(f"{prefix}.weight"), self.get(f"{prefix}.scale"), dtype)


def rank_manifest(cfg: ModelConfig, plan: ParallelPlan, rank: int) -> dict[str, TensorSpec]:
    """Stored specs of every tensor part `rank` holds, without reading anything."""
    plan.validate(cfg)
    return {
        name: shard_spec(name, spec, plan, rank, cfg.weight_block_size)
        for name, spec in manifest(cfg).items()
        if holds(name, cfg, plan, rank)
    }


def load_shard(checkpoint_dir: str, plan: ParallelPlan, rank: int) -> RankShard:
    """Read only `rank`'s tensor parts (safetensors slices) from a released-format checkpoint."""
    cfg = ModelConfig.from_file(checkpoint_dir)
    plan.validate(cfg)
    expected = manifest(cfg)
    wanted = {n for n in expected if holds(n, cfg, plan, rank)}
    tensors: dict[str, torch.Tensor] = {}
    for file, names in _files_of(checkpoint_dir, wanted).items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                tensors[name] = _read_part(f, name, expected[name], plan, rank, cfg)
    missing = sorted(wanted - set(tensors))
    if missing:
        raise ShardError(
            f"checkpoint {checkpoint_dir} lacks {len(missing)} tensors rank {rank} needs, e.g. {missing[:5]}"
        )
    return RankShard(cfg, plan, rank, tensors)


def _files_of(checkpoint_dir: str, wanted: set[str]) -> dict[str, list[str]]:
    """Shard file -> the wanted names it stores (from the index, else from the headers)."""
    index_path = os.path.join(checkpoint_dir, INDEX_FILE)
    by_file: dict[str, list[str]] = {}
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        for name, file in weight_map.items():
            if name in wanted:
                by_file.setdefault(os.path.join(checkpoint_dir, file), []).append(name)
        return by_file
    files = sorted(p for p in os.listdir(checkpoint_dir) if p.endswith(".safetensors"))
    for file in files:
        path = os.path.join(checkpoint_dir, file)
        with safe_open(path, framework="pt") as f:
            names = [n for n in f.keys() if n in wanted and not n.startswith(IGNORED_PREFIXES)]
        if names:
            by_file[path] = names
    return by_file


def _read_part(f, name: str, expected: TensorSpec, plan: ParallelPlan, rank: int, cfg: ModelConfig) -> torch.Tensor:
    stored = f.get_slice(name)
    found = TensorSpec(stored.get_dtype(), tuple(stored.get_shape()))
    if found != expected:
        raise ShardError(
            f"{name}: stored {found.dtype} {list(found.shape)}, config expects {expected.dtype} {list(expected.shape)}"
        )
    sl = tensor_slice(name, expected, plan, rank, cfg.weight_block_size)
    if sl.dim is None:
        part = stored[:]
    elif sl.dim == 0:
        part = stored[sl.start : sl.stop]
    else:
        part = stored[:, sl.start : sl.stop]
    loaded = LOADED_TORCH_DTYPES[expected.dtype]
    return part if part.dtype == loaded else part.view(loaded)  # E8M0 / I8 bytes as uint8
