"""Checkpoint tensors (raw released format, model_spec §10) -> module weights in the compute dtype.

Dequantised once at load:

    FP8 E4M3 + 32x32 UE8M0 tiles   -> compute dtype (exact in BF16)
    MXFP4 routed experts           -> compute dtype, stacked [E, out, in]
    BF16 tensors                   -> compute dtype
    F32 tensors (mHC, sink, bias)  -> kept FP32

The Engram tables stay in their raw FP8 row form (the released ones are ~98 GB each); the rows a
token hashes to are dequantised at lookup (`EngramTable.rows`). Every checkpoint tensor must be
consumed exactly once; leftovers or missing names raise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashpd.kernels.moe.ref import ExpertWeights
from flashpd.kernels.quant import ref as quant
from flashpd.model.config import LayerSpec, ModelConfig


class WeightError(KeyError):
    """A checkpoint tensor is missing, unused or of the wrong type."""


@dataclass(frozen=True)
class MixWeights:
    """One mHC site: fn [(2+S)*S, S*D], base [(2+S)*S], scale [3], all FP32."""

    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class AttentionWeights:
    wq_a: torch.Tensor  # [q_lora, D]
    q_norm: torch.Tensor  # [q_lora]
    wq_b: torch.Tensor  # [H*d, q_lora]
    wkv: torch.Tensor  # [d, D]
    kv_norm: torch.Tensor  # [d]
    wo_a: torch.Tensor  # [G*o_lora, (H/G)*d]
    wo_b: torch.Tensor  # [D, G*o_lora]
    sink: torch.Tensor  # [H] FP32


@dataclass(frozen=True)
class CompressorWeights:
    wkv: torch.Tensor  # [d, D]
    wgate: torch.Tensor | None  # [d, D], ratio 2 only
    norm: torch.Tensor  # [d]
    index_wk: torch.Tensor  # [dI, d]
    index_k_norm: torch.Tensor  # [dI]


@dataclass(frozen=True)
class IndexQueryWeights:
    wq_b: torch.Tensor  # [hI*dI, q_lora]
    weights_proj: torch.Tensor  # [hI, D]


@dataclass(frozen=True)
class MoEWeights:
    gate: torch.Tensor  # [E, D]
    bias: torch.Tensor  # [E] FP32 (selection only)
    bias_vl: torch.Tensor  # [E] FP32 (image tokens; unused for text)
    experts: ExpertWeights  # routed, [E, I, D] / [E, D, I]
    shared: ExpertWeights | None  # [1, I, D] / [1, D, I]


class EngramTable:
    """Raw FP8 Engram rows [rows, row_dim] + UE8M0 scales [rows, row_dim/32]."""

    def __init__(self, rows_f8: torch.Tensor, scale_u8: torch.Tensor):
        self.rows_f8, self.scale_u8 = rows_f8, scale_u8

    @property
    def num_rows(self) -> int:
        return self.rows_f8.shape[0]

    def rows(self, row_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """row_ids [T, C] -> looked-up rows [T, C*row_dim] in `dtype` (exact)."""
        if row_ids.numel() and (row_ids.min() < 0 or row_ids.max() >= self.num_rows):
            raise IndexError(f"Engram row id outside [0, {self.num_rows})")
        flat = row_ids.reshape(-1)
        values = quant.dequantize_fp8_rows(self.rows_f8[flat], self.scale_u8[flat], dtype)
        return values.reshape(row_ids.shape[0], -1)


@dataclass(frozen=True)
class EngramWeights:
    table: EngramTable
    wkv: torch.Tensor  # [(S+1)*D, C*row_dim]
    qk: torch.Tensor  # [S, D] FP32: q_weight * k_weight (only their product is used)


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    hc_attn: MixWeights
    hc_ffn: MixWeights
    attn: AttentionWeights
    compressor: CompressorWeights | None  # kv sources
    index_query: IndexQueryWeights | None  # index sources
    moe: MoEWeights
    engram: EngramWeights | None


@dataclass(frozen=True)
class ModelWeights:
    embed: torch.Tensor  # [V, D]
    norm: torch.Tensor  # [D]
    head: torch.Tensor  # [V, D]
    layers: tuple[LayerWeights, ...]


class _Reader:
    """Takes tensors out of a checkpoint dict by name, dequantising, and tracks what is left."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype):
        self._left = dict(tensors)
        self.dtype = dtype

    def take(self, name: str) -> torch.Tensor:
        if name not in self._left:
            raise WeightError(f"checkpoint tensor {name!r} is missing")
        return self._left.pop(name)

    def plain(self, name: str) -> torch.Tensor:
        """A BF16 tensor in the compute dtype."""
        t = self.take(name)
        if t.dtype != torch.bfloat16:
            raise WeightError(f"{name}: expected BF16, got {t.dtype}")
        return t.to(self.dtype)

    def fp32(self, name: str) -> torch.Tensor:
        t = self.take(name)
        if t.dtype != torch.float32:
            raise WeightError(f"{name}: expected F32, got {t.dtype}")
        return t

    def fp8(self, prefix: str) -> torch.Tensor:
        """`prefix.weight` E4M3 + `prefix.scale` 32x32 tiles -> compute dtype."""
        return quant.dequantize_fp8_blockwise(self.take(f"{prefix}.weight"), self.take(f"{prefix}.scale"), self.dtype)

    def mxfp4(self, prefix: str) -> torch.Tensor:
        return quant.dequantize_mxfp4_weight(self.take(f"{prefix}.weight"), self.take(f"{prefix}.scale"), self.dtype)

    def finish(self) -> None:
        if self._left:
            names = sorted(self._left)
            raise WeightError(f"{len(names)} checkpoint tensors unused, e.g. {names[:5]}")


def load_weights(cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> ModelWeights:
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"compute dtype must be bfloat16 or float32, got {dtype}")
    r = _Reader(tensors, dtype)
    layers = tuple(_layer(cfg, spec, r) for spec in cfg.layers)
    weights = ModelWeights(
        embed=r.plain("embed.weight"), norm=r.plain("norm.weight"), head=r.plain("head.weight"), layers=layers
    )
    r.finish()
    return weights


def _layer(cfg: ModelConfig, spec: LayerSpec, r: _Reader) -> LayerWeights:
    p = f"layers.{spec.layer_id}."
    return LayerWeights(
        attn_norm=r.plain(p + "attn_norm.weight"),
        ffn_norm=r.plain(p + "ffn_norm.weight"),
        hc_attn=_mix(r, p + "hc_attn"),
        hc_ffn=_mix(r, p + "hc_ffn"),
        attn=_attention(r, p),
        compressor=_compressor(spec, r, p) if spec.owns_compressor else None,
        index_query=IndexQueryWeights(
            wq_b=r.fp8(p + "attn.indexer.wq_b"), weights_proj=r.plain(p + "attn.indexer.weights_proj.weight")
        )
        if spec.owns_index_query
        else None,
        moe=_moe(cfg, r, p, cfg.n_routed_experts),
        engram=_engram(r, p) if spec.has_engram else None,
    )


def _attention(r: _Reader, p: str) -> AttentionWeights:
    return AttentionWeights(
        wq_a=r.fp8(p + "attn.wq_a"),
        q_norm=r.plain(p + "attn.q_norm.weight"),
        wq_b=r.fp8(p + "attn.wq_b"),
        wkv=r.fp8(p + "attn.wkv"),
        kv_norm=r.plain(p + "attn.kv_norm.weight"),
        wo_a=r.fp8(p + "attn.wo_a"),
        wo_b=r.fp8(p + "attn.wo_b"),
        sink=r.fp32(p + "attn.attn_sink"),
    )


def _mix(r: _Reader, prefix: str) -> MixWeights:
    return MixWeights(fn=r.fp32(prefix + "_fn"), base=r.fp32(prefix + "_base"), scale=r.fp32(prefix + "_scale"))


def _compressor(spec: LayerSpec, r: _Reader, p: str) -> CompressorWeights:
    return CompressorWeights(
        wkv=r.plain(p + "attn.compressor.wkv.weight"),
        wgate=r.plain(p + "attn.compressor.wgate.weight") if spec.ratio > 1 else None,
        norm=r.plain(p + "attn.compressor.norm.weight"),
        index_wk=r.plain(p + "attn.indexer.wk.weight"),
        index_k_norm=r.plain(p + "attn.indexer.k_norm.weight"),
    )


def _moe(cfg: ModelConfig, r: _Reader, p: str, n_experts: int) -> MoEWeights:
    gate = r.plain(p + "ffn.gate.weight")
    bias, bias_vl = r.fp32(p + "ffn.gate.bias"), r.fp32(p + "ffn.gate.bias_vl")
    w1, w2, w3 = [], [], []
    for e in range(n_experts):
        w1.append(r.mxfp4(f"{p}ffn.experts.{e}.w1"))
        w2.append(r.mxfp4(f"{p}ffn.experts.{e}.w2"))
        w3.append(r.mxfp4(f"{p}ffn.experts.{e}.w3"))
    experts = ExpertWeights(torch.stack(w1), torch.stack(w3), torch.stack(w2))
    shared = None
    if cfg.n_shared_experts:
        s = p + "ffn.shared_experts."
        shared = ExpertWeights(r.fp8(s + "w1")[None], r.fp8(s + "w3")[None], r.fp8(s + "w2")[None])
    return MoEWeights(gate=gate, bias=bias, bias_vl=bias_vl, experts=experts, shared=shared)


def _engram(r: _Reader, p: str) -> EngramWeights:
    table = EngramTable(r.take(p + "engram.embed.weight"), r.take(p + "engram.embed.scale"))
    q = r.take(p + "engram.q_weight").to(torch.float32)
    k = r.take(p + "engram.k_weight").to(torch.float32)
    return EngramWeights(table=table, wkv=r.fp8(p + "engram.wkv"), qk=q * k)


# ============================================================================ DSpark drafter
@dataclass(frozen=True)
class DrafterLayerWeights:
    """One drafter stage `mtp.s`: a V4.1 block without compressor, indexer or Engram."""

    attn_norm: torch.Tensor  # [D]
    ffn_norm: torch.Tensor  # [D]
    hc_attn: MixWeights
    hc_ffn: MixWeights
    attn: AttentionWeights
    moe: MoEWeights  # dspark_n_routed_experts routed + the shared expert


@dataclass(frozen=True)
class DrafterWeights:
    """The DSpark drafter (shared/docs/dspark.md §2.5); embed and head are the target's."""

    main_proj: torch.Tensor  # [D, n_taps*D]
    main_norm: torch.Tensor  # [D]
    layers: tuple[DrafterLayerWeights, ...]
    norm: torch.Tensor  # [D], mtp.{last}.norm before the target's head
    markov_embed: torch.Tensor  # [V, r] FP32 (stored BF16, run in FP32)
    markov_head: torch.Tensor  # [V, r] FP32
    confidence: torch.Tensor  # [D + r] FP32: weights of [x_k ; E[prev]]


def load_drafter_weights(cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> DrafterWeights:
    """`mtp.*` checkpoint tensors (raw form) -> dequantised drafter weights; every one consumed."""
    r = _Reader(tensors, dtype)
    weights = drafter_weights_from(cfg, r)
    r.finish()
    return weights


def drafter_weights_from(cfg: ModelConfig, r) -> DrafterWeights:
    """The drafter's weights from a reader of `mtp.*` names (`plain`, `fp32`, `fp8`, `mxfp4` as
    `_Reader`'s; training passes one over fake-quantised master weights, model/train_drafter.py)."""
    ds = cfg.dspark
    if ds is None:
        raise ValueError(f"config {cfg.name!r} has no drafter (num_nextn_predict_layers = 0)")
    layers = tuple(_drafter_layer(cfg, r, f"mtp.{s}.") for s in range(ds.num_layers))
    last = f"mtp.{ds.num_layers - 1}."
    return DrafterWeights(
        main_proj=r.fp8("mtp.0.main_proj"),
        main_norm=r.plain("mtp.0.main_norm.weight"),
        layers=layers,
        norm=r.plain(last + "norm.weight"),
        markov_embed=r.plain(last + "markov_head.embed.weight").float(),
        markov_head=r.plain(last + "markov_head.head.weight").float(),
        confidence=r.plain(last + "confidence_head.proj.weight").float()[0],
    )


def _drafter_layer(cfg: ModelConfig, r, p: str) -> DrafterLayerWeights:
    return DrafterLayerWeights(
        attn_norm=r.plain(p + "attn_norm.weight"),
        ffn_norm=r.plain(p + "ffn_norm.weight"),
        hc_attn=_mix(r, p + "hc_attn"),
        hc_ffn=_mix(r, p + "hc_ffn"),
        attn=_attention(r, p),
        moe=_moe(cfg, r, p, cfg.dspark.n_routed_experts),
    )
