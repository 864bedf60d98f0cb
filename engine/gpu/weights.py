"""Weights of the GPU forward, kept in the checkpoint's formats (model_spec §10).

The reference model (model/weights.py) dequantises every tensor at load; the `bench` preset
(~59 GB in checkpoint formats) fits one H200 only if nothing is widened. Here each checkpoint
tensor maps onto the operand form the Triton kernels read, without touching its values:

    checkpoint (loaded form, model/checkpoint.py)              GPU form
    <x>.weight E4M3 [out, in] + <x>.scale u8 tiles             Weights.fp8, E = 1
    attn.wo_a E4M3 [G*o_lora, (H/G)*d] + tiles                 Weights.fp8, E = G: [G, o_lora, (H/G)*d]
                                                               and tiles [G, o_lora/32, .] (views)
    ffn.experts.{e}.wN packed u8 [out, in/2] + u8 [out, in/32] ExpertSet of MXFP4 Weights [E, ...]
    ffn.shared_experts.wN E4M3 + tiles                         ExpertSet of FP8 Weights, E = 1
    engram.embed.weight E4M3 [rows, 256] + u8 [rows, 8]        HostTable (host memory)
    engram.q_weight, k_weight BF16 [S, D]                      qk = q * k, FP32 on the device
    mHC hc_*_fn / _base / _scale F32                           (fn, base, scale) tuple
    BF16 norms, router gate, compressor / indexer tensors      as stored, on the device
    ffn.gate.bias F32                                          gate_bias; bias_vl (images) dropped

Every checkpoint tensor is consumed exactly once and checked against `manifest(cfg)` (dtype of
the loaded form, shape): a missing one raises WeightError (a KeyError) naming it, leftovers raise
listing a few. Tensors already on `device` and contiguous are used in place (views, no copy);
per-expert tensors that are consecutive slices of one buffer (as `random_checkpoint_tensors`
makes them) are stacked as a view, others with one `torch.stack`.

`random_checkpoint_tensors` draws a whole checkpoint dict on a device in seconds, which both
`model.weights.load_weights` and `from_checkpoint_tensors` accept. Scales put every random
projection's outputs at unit order (`_scale_byte`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# isort: off
from flashpd.kernels import triton_runtime  # noqa: F401  (before any kernel import)
# isort: on

from flashpd.kernels.dense.triton import Weights
from flashpd.kernels.engram.triton import HostTable
from flashpd.kernels.moe.triton import ExpertSet
from flashpd.model.checkpoint import LOADED_TORCH_DTYPES, TensorSpec, init_rule, manifest
from flashpd.model.config import LayerSpec, ModelConfig
from flashpd.model.weights import MixWeights, WeightError

_TILE = 32  # the kernels' FP8 scale tile is 32 x 32 (kernels/dense/triton.py)
_ENGRAM_SCALE_BYTE = 127  # random Engram rows are N(0, 1) E4M3 codes times 2^0
_ENGRAM_CHUNK_ROWS = 1 << 20


# ============================================================================ structures
@dataclass
class EngramWeights:
    table: HostTable  # host memory, zero-copy gathered
    wkv: Weights  # FP8 [(S+1)*D, C*row_dim]
    qk: torch.Tensor  # FP32 [S, D] = q_weight * k_weight


@dataclass
class LayerWeights:
    spec: LayerSpec
    wq_a_kv: Weights  # FP8 [wq_a; wkv] stacked along N: one GEMM over the layer's input
    q_lora: int  # wq_a's rows in wq_a_kv (the rest are wkv's)
    q_norm: torch.Tensor
    wq_b: Weights
    kv_norm: torch.Tensor
    wo_a: Weights  # FP8 [G, o_lora, H/G * d] (block-diagonal wo_a as G experts)
    wo_b: Weights
    sink: torch.Tensor
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    hc_attn: MixWeights  # fn, base, scale (FP32)
    hc_ffn: MixWeights
    gate: torch.Tensor  # BF16 [E, D]
    gate_bias: torch.Tensor  # FP32 [E]
    experts: ExpertSet  # MXFP4
    shared: ExpertSet  # FP8
    comp_wkv: torch.Tensor | None = None  # BF16 [d, D]
    comp_wgate: torch.Tensor | None = None  # BF16 [d, D] (ratio 2 only)
    comp_norm: torch.Tensor | None = None
    idx_wq_b: Weights | None = None  # FP8 [nh*dI, q_lora]
    idx_proj: torch.Tensor | None = None  # BF16 [nh, D]
    idx_wk: torch.Tensor | None = None  # BF16 [dI, d]
    idx_k_norm: torch.Tensor | None = None
    engram: EngramWeights | None = None

    @property
    def wq_a(self) -> Weights:
        return out_rows(self.wq_a_kv, 0, self.q_lora)

    @property
    def wkv(self) -> Weights:
        return out_rows(self.wq_a_kv, self.q_lora, self.wq_a_kv.out_dim)


def out_rows(w: Weights, start: int, end: int) -> Weights:
    """Output rows [start, end) of a single FP8 or plain weight, as views (no copy); FP8 bounds
    must be multiples of the 32-row scale tile."""
    if w.scale is None:
        return Weights(w.fmt, w.data[:, start:end])
    if start % _TILE or (end % _TILE and end != w.out_dim):
        raise ValueError(f"rows [{start}, {end}) split a {_TILE}-row scale tile")
    return Weights(w.fmt, w.data[:, start:end], w.scale[:, start // _TILE : -(-end // _TILE)])


@dataclass
class GpuWeights:
    cfg: ModelConfig
    layers: list[LayerWeights]
    norm: torch.Tensor  # BF16 [D]
    head: torch.Tensor  # BF16 [vocab, D], FP32 accumulation
    embed: torch.Tensor  # BF16 [vocab, D]


# ============================================================================ random scales
def _scale_byte(fan_in: int, fp4: bool) -> int:
    """UE8M0 byte giving outputs of unit order: 2^-(log2(sqrt(fan_in))) (FP4 codes ~2x larger)."""
    return 127 - round(0.5 * math.log2(fan_in)) - (1 if fp4 else 0)


# ============================================================================ from a checkpoint
class _Taker:
    """Takes checkpoint tensors by name (each once), checks them against the manifest, and moves
    them to the device; `finish` raises on leftovers."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], device: torch.device):
        self._left = dict(tensors)
        self._specs = manifest(cfg)
        self.device = device

    def raw(self, name: str) -> torch.Tensor:
        """The tensor where it lies (checked), not moved."""
        if name not in self._left:
            raise WeightError(f"checkpoint tensor {name!r} is missing")
        t = self._left.pop(name)
        spec = self._specs[name]
        want = LOADED_TORCH_DTYPES[spec.dtype]
        if t.dtype != want:
            raise WeightError(f"{name}: dtype {t.dtype}, expected {want} ({spec.dtype})")
        if tuple(t.shape) != spec.shape:
            raise WeightError(f"{name}: shape {list(t.shape)}, expected {list(spec.shape)}")
        return t

    def take(self, name: str) -> torch.Tensor:
        return self.raw(name).to(self.device).contiguous()

    def fp8(self, prefix: str) -> Weights:
        return Weights.fp8(self.take(prefix + ".weight"), self.take(prefix + ".scale"))

    def mix(self, prefix: str) -> MixWeights:
        return MixWeights(self.take(prefix + "_fn"), self.take(prefix + "_base"), self.take(prefix + "_scale"))

    def finish(self) -> None:
        if self._left:
            names = sorted(self._left)
            raise WeightError(f"{len(names)} checkpoint tensors unused, e.g. {names[:5]}")


def from_checkpoint_tensors(
    cfg: ModelConfig, tensors: dict[str, torch.Tensor], device: str | torch.device
) -> GpuWeights:
    """Checkpoint tensors in their loaded form (`model.checkpoint.load_checkpoint`) -> GpuWeights
    on `device`, nothing dequantised. `tensors` is not modified; see the module doc for copies."""
    if tuple(cfg.weight_block_size) != (_TILE, _TILE):
        raise ValueError(f"weight_block_size {cfg.weight_block_size}: the kernels read 32x32 FP8 scale tiles only")
    if cfg.n_shared_experts < 1:
        raise ValueError("n_shared_experts = 0: the GPU forward expects the shared expert")
    t = _Taker(cfg, tensors, torch.device(device))
    layers = [_layer(cfg, spec, t) for spec in cfg.layers]
    weights = GpuWeights(
        cfg, layers, norm=t.take("norm.weight"), head=t.take("head.weight"), embed=t.take("embed.weight")
    )
    t.finish()
    return weights


def _layer(cfg: ModelConfig, spec: LayerSpec, t: _Taker) -> LayerWeights:
    p = f"layers.{spec.layer_id}."
    gate_bias = t.take(p + "ffn.gate.bias")
    t.raw(p + "ffn.gate.bias_vl")  # image-token routing bias: text only, dropped
    lw = LayerWeights(
        spec=spec,
        wq_a_kv=Weights.stack_out([t.fp8(p + "attn.wq_a"), t.fp8(p + "attn.wkv")]),
        q_lora=cfg.q_lora_rank,
        q_norm=t.take(p + "attn.q_norm.weight"),
        wq_b=t.fp8(p + "attn.wq_b"),
        kv_norm=t.take(p + "attn.kv_norm.weight"),
        wo_a=_grouped_wo_a(cfg, t, p + "attn.wo_a"),
        wo_b=t.fp8(p + "attn.wo_b"),
        sink=t.take(p + "attn.attn_sink"),
        attn_norm=t.take(p + "attn_norm.weight"),
        ffn_norm=t.take(p + "ffn_norm.weight"),
        hc_attn=t.mix(p + "hc_attn"),
        hc_ffn=t.mix(p + "hc_ffn"),
        gate=t.take(p + "ffn.gate.weight"),
        gate_bias=gate_bias,
        experts=_routed_experts(cfg, t, p),
        shared=_shared_expert(t, p),
    )
    if spec.owns_compressor:
        lw.comp_wkv = t.take(p + "attn.compressor.wkv.weight")
        if spec.ratio > 1:
            lw.comp_wgate = t.take(p + "attn.compressor.wgate.weight")
        lw.comp_norm = t.take(p + "attn.compressor.norm.weight")
        lw.idx_wk = t.take(p + "attn.indexer.wk.weight")
        lw.idx_k_norm = t.take(p + "attn.indexer.k_norm.weight")
    if spec.owns_index_query:
        lw.idx_wq_b = t.fp8(p + "attn.indexer.wq_b")
        lw.idx_proj = t.take(p + "attn.indexer.weights_proj.weight")
    if spec.has_engram:
        lw.engram = _engram(t, p)
    return lw


def _grouped_wo_a(cfg: ModelConfig, t: _Taker, prefix: str) -> Weights:
    """wo_a [G*o_lora, (H/G)*d] -> G "experts" [G, o_lora, (H/G)*d]; a group must own whole
    32-row scale tiles, so o_lora must be a multiple of 32."""
    groups, rank = cfg.o_groups, cfg.o_lora_rank
    if rank % _TILE:
        raise ValueError(
            f"{prefix}: o_lora_rank {rank} is not a multiple of the {_TILE}-row "
            f"scale tile, so its {groups} groups would share tiles"
        )
    w, s = t.take(prefix + ".weight"), t.take(prefix + ".scale")
    return Weights.fp8(w.view(groups, rank, w.shape[1]), s.view(groups, rank // _TILE, s.shape[1]))


def _stack(parts: list[torch.Tensor]) -> torch.Tensor:
    """[E] equal tensors -> [E, ...]: a view when they are consecutive slices of one buffer."""
    first, step = parts[0], parts[0].numel()
    in_place = all(
        p.is_contiguous()
        and p.shape == first.shape
        and p.device == first.device
        and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and p.storage_offset() == first.storage_offset() + e * step
        for e, p in enumerate(parts)
    )
    if in_place:
        return first.as_strided((len(parts), *first.shape), (step, *first.stride()))
    return torch.stack(parts)


def _routed_experts(cfg: ModelConfig, t: _Taker, p: str) -> ExpertSet:
    def stacked(w: str) -> Weights:
        names = [f"{p}ffn.experts.{e}.{w}" for e in range(cfg.n_routed_experts)]
        packed = _stack([t.raw(n + ".weight") for n in names]).to(t.device).contiguous()
        scale = _stack([t.raw(n + ".scale") for n in names]).to(t.device).contiguous()
        return Weights.mxfp4(packed, scale)

    return ExpertSet(w1=stacked("w1"), w3=stacked("w3"), w2=stacked("w2"))


def _shared_expert(t: _Taker, p: str) -> ExpertSet:
    s = p + "ffn.shared_experts."
    return ExpertSet(w1=t.fp8(s + "w1"), w3=t.fp8(s + "w3"), w2=t.fp8(s + "w2"))


def _engram(t: _Taker, p: str) -> EngramWeights:
    table = HostTable.from_quantized(t.raw(p + "engram.embed.weight"), t.raw(p + "engram.embed.scale"))
    q = t.take(p + "engram.q_weight").to(torch.float32)
    k = t.take(p + "engram.k_weight").to(torch.float32)
    return EngramWeights(table=table, wkv=t.fp8(p + "engram.wkv"), qk=q * k)


# ============================================================================ random checkpoint
def random_checkpoint_tensors(cfg: ModelConfig, seed: int, device: str | torch.device) -> dict[str, torch.Tensor]:
    """A random checkpoint of `cfg` in the loaded form of `load_checkpoint`, in manifest order.

    Everything is drawn on `device` from one generator seeded with `seed`: FP8 weights are
    N(0, 1) E4M3 codes (never NaN) with `_scale_byte` tiles; routed experts are uniform E2M1
    bytes drawn as one [E, out, in/2] buffer per layer and weight, handed out as per-expert
    views (so `from_checkpoint_tensors` stacks them without a copy); plain BF16 / F32 tensors
    follow the rules of `model.checkpoint` (`init_rule`). Engram tables are drawn on `device`
    in chunks and returned in host memory (the serving path keeps them there).
    """
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    specs = manifest(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, spec in specs.items():
        if name in out:  # a scale drawn with its weight, or an expert drawn with expert 0
            continue
        if spec.dtype == "I8":
            out.update(_random_experts(cfg, specs, name, gen, device))
        elif name.endswith("engram.embed.weight"):
            out.update(_random_engram_table(specs, name, gen, device))
        elif spec.dtype == "F8_E4M3":
            scale_name = name[: -len(".weight")] + ".scale"
            out[name] = _randn(spec.shape, torch.bfloat16, gen, device).to(torch.float8_e4m3fn)
            out[scale_name] = torch.full(
                specs[scale_name].shape, _scale_byte(spec.shape[1], False), dtype=torch.uint8, device=device
            )
        elif spec.dtype in ("BF16", "F32"):
            out[name] = _random_plain(name, spec, gen, device)
        else:
            raise ValueError(f"{name}: no random rule for {spec.dtype}")
    return {name: out[name] for name in specs}


def _randn(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.randn(shape, dtype=dtype, generator=gen, device=device)


def _random_plain(name: str, spec: TensorSpec, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    dtype = LOADED_TORCH_DTYPES[spec.dtype]
    kind, std = init_rule(name, spec)
    if kind == "ones":
        return torch.ones(spec.shape, dtype=dtype, device=device)
    if kind == "zeros":
        return torch.zeros(spec.shape, dtype=dtype, device=device)
    return _randn(spec.shape, dtype, gen, device).mul_(std)


def _random_experts(
    cfg: ModelConfig, specs: dict[str, TensorSpec], name: str, gen: torch.Generator, device: torch.device
) -> dict[str, torch.Tensor]:
    """All experts' `wN` of one layer, from the name of expert 0's: views of one buffer."""
    layer, rest = name.split(".ffn.experts.")
    expert, w, _ = rest.split(".")
    if expert != "0":
        raise ValueError(f"{name}: expected expert 0 first in manifest order")
    spec = specs[name]
    num = cfg.n_routed_experts
    scale_shape = specs[name[: -len(".weight")] + ".scale"].shape
    packed = torch.empty((num, *spec.shape), dtype=torch.uint8, device=device)
    packed.random_(0, 256, generator=gen)  # every byte is two valid E2M1 codes
    scale = torch.full((num, *scale_shape), _scale_byte(2 * spec.shape[1], True), dtype=torch.uint8, device=device)
    out = {}
    for e in range(num):
        out[f"{layer}.ffn.experts.{e}.{w}.weight"] = packed[e]
        out[f"{layer}.ffn.experts.{e}.{w}.scale"] = scale[e]
    return out


def _random_engram_table(
    specs: dict[str, TensorSpec], name: str, gen: torch.Generator, device: torch.device
) -> dict[str, torch.Tensor]:
    """N(0, 1) E4M3 rows drawn on `device` in chunks, returned on the host, scales 2^0."""
    spec = specs[name]
    scale_name = name[: -len(".weight")] + ".scale"
    num_rows, row_dim = spec.shape
    rows = torch.empty(spec.shape, dtype=torch.float8_e4m3fn)
    for r0 in range(0, num_rows, _ENGRAM_CHUNK_ROWS):
        n = min(_ENGRAM_CHUNK_ROWS, num_rows - r0)
        rows[r0 : r0 + n] = _randn((n, row_dim), torch.bfloat16, gen, device).to(torch.float8_e4m3fn).cpu()
    scale = torch.full(specs[scale_name].shape, _ENGRAM_SCALE_BYTE, dtype=torch.uint8)
    return {name: rows, scale_name: scale}
