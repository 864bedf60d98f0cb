"""ModelConfig: the released DeepSeek-V4.1-Flash `config.json` translated once into named fields.

Everything downstream (model, engine, byte accounting) reads these fields; nothing re-parses the
HF dict or guesses features from magic numbers. Per-layer roles follow model_spec.md §1.3:

    ratio 0                          -> SWA_ONLY  (window attention only)
    layer in kv_source_layer_ids     -> FULL      (owns compressor + index keys; also index source)
    layer in index_source \\ kv_source -> REINDEX  (own index query over kv_src's keys)
    otherwise                        -> REUSE     (reuses kv_src's cache and idx_src's top-k)
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from dataclasses import dataclass
from typing import Any, NamedTuple


class LayerRole(str, enum.Enum):
    SWA_ONLY = "swa_only"
    FULL = "full"
    REINDEX = "reindex"
    REUSE = "reuse"


class LayerGroup(NamedTuple):
    """Layers that touch the same rows of a step (`Step.rows`), keyed by the two facts that
    decide them: a decoder layer (from the candidate source on) skips a prefill's encoder-only
    rows; a layer that owns a compressor also keeps the seam rows its compressor reads."""

    decoder: bool
    owns_compressor: bool


@dataclass(frozen=True)
class LayerSpec:
    """Resolved role of one backbone layer (model_spec §1.3)."""

    layer_id: int
    ratio: int  # compress ratio of the cache this layer reads (0 = none)
    role: LayerRole
    kv_src: int | None  # layer whose compressed cache this layer reads
    idx_src: int | None  # layer whose top-k this layer uses
    is_candidate_source: bool
    uses_candidates: bool  # an index source after the candidate source (candidate-masked)
    has_engram: bool
    engram_index: int | None  # position in engram_layer_ids
    is_encoder: bool  # before the candidate source (layers 0..19 released)

    @property
    def owns_compressor(self) -> bool:
        return self.role is LayerRole.FULL

    @property
    def owns_index_query(self) -> bool:
        return self.role in (LayerRole.FULL, LayerRole.REINDEX)

    @property
    def group(self) -> LayerGroup:
        return LayerGroup(decoder=not self.is_encoder, owns_compressor=self.owns_compressor)


@dataclass(frozen=True)
class RopeConfig:
    theta: float  # base for SWA-only layers (no YaRN)
    compress_theta: float  # base for ratio>0 layers (with YaRN)
    yarn_factor: float
    yarn_beta_fast: float
    yarn_beta_slow: float
    yarn_original_max_position: int


@dataclass(frozen=True)
class DSparkConfig:
    """The DSpark drafter's released keys (docs/dspark.md; shared/docs/dspark.md §2).

    Three SWA-only layers (`mtp.0..2`) run in series on a block [anchor, noise x (k-1)]; their
    context K/V comes from a tap of the target's residual entering `target_layer_ids`.
    """

    num_layers: int  # num_nextn_predict_layers: stacked drafter layers (3), not MTP stages
    block_size: int  # dspark_block_size: k slots = k drafts per step (5)
    noise_token_id: int  # dspark_noise_token_id: embedding row of the k-1 noise slots
    target_layer_ids: tuple[int, ...]  # dspark_target_layer_ids: tap layers, ascending
    markov_rank: int  # dspark_markov_rank: r of the Markov head (E, H are [V, r])
    n_routed_experts: int  # dspark_n_routed_experts
    num_experts_per_tok: int  # dspark_num_experts_per_tok
    compress_ratios: tuple[int, ...]  # the trailing compress_ratios entries: all 0 (SWA-only)

    @property
    def tap_dim_factor(self) -> int:
        """main_hidden is [T, len(target_layer_ids) * hidden_size]."""
        return len(self.target_layer_ids)

    @classmethod
    def from_hf(cls, t: dict[str, Any], num_layers: int) -> DSparkConfig | None:
        """None when num_nextn_predict_layers is 0 or absent (a config without a drafter)."""
        n = _int_key(t, "num_nextn_predict_layers", default=0)
        if n < 0:
            raise ValueError(f"num_nextn_predict_layers must be >= 0, got {n}")
        if n == 0:
            return None
        return cls(
            num_layers=n,
            compress_ratios=_drafter_ratios(t, num_layers, n),
            target_layer_ids=_target_layer_ids(t),
            block_size=_int_key(t, "dspark_block_size"),
            noise_token_id=_int_key(t, "dspark_noise_token_id"),
            markov_rank=_int_key(t, "dspark_markov_rank"),
            n_routed_experts=_int_key(t, "dspark_n_routed_experts"),
            num_experts_per_tok=_int_key(t, "dspark_num_experts_per_tok"),
        )

    def to_hf(self) -> dict[str, Any]:
        """The released keys (compress_ratios' tail is appended by ModelConfig.to_hf)."""
        return {
            "num_nextn_predict_layers": self.num_layers,
            "dspark_block_size": self.block_size,
            "dspark_noise_token_id": self.noise_token_id,
            "dspark_target_layer_ids": list(self.target_layer_ids),
            "dspark_markov_rank": self.markov_rank,
            "dspark_n_routed_experts": self.n_routed_experts,
            "dspark_num_experts_per_tok": self.num_experts_per_tok,
        }

    def problems(self, num_layers: int, vocab_size: int) -> list[str]:
        """What is wrong against the backbone, each message naming its key."""
        return self._block_problems(vocab_size) + self._target_problems(num_layers) + self._head_problems()

    def _block_problems(self, vocab_size: int) -> list[str]:
        """The drafter's own layers and its [anchor, noise x (k-1)] block."""
        out = []
        if self.num_layers < 1:
            out.append(f"num_nextn_predict_layers must be >= 1 with a drafter, got {self.num_layers}")
        if len(self.compress_ratios) != self.num_layers or any(self.compress_ratios):
            out.append(
                f"compress_ratios: the {self.num_layers} trailing (drafter) entries must "
                f"be 0 (SWA-only), got {list(self.compress_ratios)}"
            )
        if self.block_size < 1:
            out.append(f"dspark_block_size must be >= 1, got {self.block_size}")
        if not 0 <= self.noise_token_id < vocab_size:
            out.append(f"dspark_noise_token_id {self.noise_token_id} outside the vocabulary [0, {vocab_size})")
        return out

    def _target_problems(self, num_layers: int) -> list[str]:
        """The tap layers: non-empty, backbone layers, strictly ascending."""
        ids = self.target_layer_ids
        out = []
        if not ids:
            out.append("dspark_target_layer_ids is empty")
        if any(not 0 <= i < num_layers for i in ids):
            out.append(f"dspark_target_layer_ids {list(ids)}: every id must be a backbone layer in [0, {num_layers})")
        if list(ids) != sorted(set(ids)):
            out.append(f"dspark_target_layer_ids {list(ids)} must be strictly ascending")
        return out

    def _head_problems(self) -> list[str]:
        """The Markov head's rank and the drafter's MoE routing."""
        out = []
        if self.markov_rank < 1:
            out.append(f"dspark_markov_rank must be >= 1, got {self.markov_rank}")
        if self.n_routed_experts < 1:
            out.append(f"dspark_n_routed_experts must be >= 1, got {self.n_routed_experts}")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            out.append(
                f"dspark_num_experts_per_tok {self.num_experts_per_tok} outside "
                f"[1, dspark_n_routed_experts={self.n_routed_experts}]"
            )
        return out


def _drafter_ratios(t: dict[str, Any], num_layers: int, n: int) -> tuple[int, ...]:
    """The trailing `n` compress_ratios entries (the drafter's layers)."""
    ratios = t["compress_ratios"]
    if len(ratios) != num_layers + n:
        raise ValueError(
            f"compress_ratios has {len(ratios)} entries; with "
            f"num_nextn_predict_layers={n} it needs num_hidden_layers + {n} = "
            f"{num_layers + n}"
        )
    return tuple(int(r) for r in ratios[num_layers:])


def _target_layer_ids(t: dict[str, Any]) -> tuple[int, ...]:
    ids = t.get("dspark_target_layer_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"dspark_target_layer_ids must be a list of layer ids, got {ids!r}")
    return tuple(ids)


def _int_key(t: dict[str, Any], key: str, default: int | None = None) -> int:
    """An integer config key; a missing key (without default) or a non-integer raises."""
    if key not in t:
        if default is None:
            raise ValueError(f"config lacks {key} (required when num_nextn_predict_layers > 0)")
        return default
    value = t[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    return value


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]  # backbone layers only (DSpark tail: dspark.compress_ratios)
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    swiglu_limit: float
    gate_temp: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_vocab_size: int  # prime search start (model_spec §8.3)
    engram_compressed_vocab_size: int
    engram_pad_token_id: int
    image_token_id: int | None
    weight_block_size: tuple[int, int] = (32, 32)
    tie_word_embeddings: bool = False
    dspark: DSparkConfig | None = None  # the drafter; None: num_nextn_predict_layers = 0

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str = "model") -> ModelConfig:
        """Translate a released-style config dict (nested `text_config` or flat)."""
        t = hf.get("text_config", hf)
        n_layers = int(t["num_hidden_layers"])
        q = hf.get("quantization_config") or {}
        cfg = cls(
            name=name,
            **_layer_source_fields(t, n_layers),
            rope=_rope_from_hf(t),
            **_engram_fields(t),
            **_shape_fields(t),
            **_moe_and_hc_fields(t),
            image_token_id=hf.get("image_token_id"),
            weight_block_size=tuple(q.get("weight_block_size", (32, 32))),
            tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
            dspark=DSparkConfig.from_hf(t, n_layers),
        )
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str) -> ModelConfig:
        """Load `config.json` (or a checkpoint directory containing one)."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            hf = json.load(f)
        name = hf.get("flashpd_preset") or os.path.basename(os.path.dirname(os.path.abspath(path)))
        return cls.from_hf(hf, name=name)

    def to_hf(self) -> dict[str, Any]:
        """Inverse of from_hf: a released-style dict (nested text_config)."""
        out: dict[str, Any] = {
            "architectures": ["DeepseekV41ForCausalLM"],
            "model_type": "deepseek_v41",
            "flashpd_preset": self.name,
            "text_config": _hf_text_config(self),
            "quantization_config": _hf_quantization(self),
            "torch_dtype": "bfloat16",
        }
        if self.image_token_id is not None:
            out["image_token_id"] = self.image_token_id
        return out

    def replace(self, **changes: Any) -> ModelConfig:
        cfg = dataclasses.replace(self, **changes)
        cfg.validate()
        return cfg

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise on the first inconsistency, naming the released key."""
        self._validate_widths()
        self._validate_layer_sources()
        self._need(
            len(self.engram_layer_ids) == len(self.engram_num_embeddings),
            "engram_layer_ids and engram_num_embeddings differ in length",
        )
        self._need(self.hc_mult >= 1 and self.hc_sinkhorn_iters >= 1, "hc_mult / hc_sinkhorn_iters")
        self._need(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok > n_routed_experts")
        self._need(self.n_shared_experts in (0, 1), "n_shared_experts must be 0 or 1")
        if self.dspark is not None:
            for problem in self.dspark.problems(self.num_layers, self.vocab_size):
                self._need(False, problem)

    def _need(self, ok: bool, msg: str) -> None:
        if not ok:
            raise ValueError(f"invalid ModelConfig {self.name!r}: {msg}")

    def _validate_widths(self) -> None:
        """Head splits and the 32-channel quantization blocks of the KV formats."""
        self._need(self.num_heads % self.o_groups == 0, "num_attention_heads % o_groups != 0")
        self._need(self.rope_head_dim % 2 == 0 and self.rope_head_dim <= self.head_dim, "qk_rope_head_dim")
        self._need(self.rope_head_dim <= self.index_head_dim, "qk_rope_head_dim > index_head_dim")
        self._need(self.head_dim % 32 == 0, "head_dim must be a multiple of 32 (FP8/NVFP4 blocks)")
        self._need(self.index_head_dim % 32 == 0, "index_head_dim must be a multiple of 32 (MXFP4)")

    def _validate_layer_sources(self) -> None:
        """Every compressed layer reads KV from an earlier-or-same source of the same ratio."""
        ratios = self.compress_ratios
        self._need(all(r in (0, 1, 2) for r in ratios), "compress_ratios must be 0, 1 or 2")
        self._need(
            set(self.kv_source_layer_ids) <= set(self.index_source_layer_ids), "every kv source must be an index source"
        )
        for s in self.kv_source_layer_ids:
            self._need(0 <= s < self.num_layers and ratios[s] > 0, f"kv source {s} must be a layer with ratio > 0")
        for layer, r in enumerate(ratios):
            if r > 0:
                src = [s for s in self.kv_source_layer_ids if s <= layer]
                self._need(bool(src), f"layer {layer} has ratio {r} but no kv source at or before it")
                self._need(ratios[max(src)] == r, f"layer {layer} ratio {r} differs from its kv source {max(src)}")
        self._need(
            self.candidate_source_layer_id in self.kv_source_layer_ids, "candidate_source_layer_id must be a kv source"
        )

    # ------------------------------------------------------------------ roles
    @property
    def layers(self) -> tuple[LayerSpec, ...]:
        """Resolved once per config object (it is frozen); hot paths read it every step."""
        layers = self.__dict__.get("_layers")
        if layers is None:
            layers = _resolve_layers(self)
            object.__setattr__(self, "_layers", layers)
        return layers

    @property
    def encoder_layer_ids(self) -> tuple[int, ...]:
        """Layers run on every prompt token by the prefill worker (0..19 released)."""
        return tuple(range(self.candidate_source_layer_id))

    # ------------------------------------------------------------------ bytes
    @property
    def compressed_entry_bytes(self) -> int:
        """NVFP4 main-KV record: packed E2M1 + one E4M3 scale per 16 channels (288 B)."""
        return self.head_dim // 2 + self.head_dim // 16

    @property
    def index_entry_bytes(self) -> int:
        """MXFP4 index-key record: packed E2M1 + one UE8M0 scale per 32 channels (68 B)."""
        return self.index_head_dim // 2 + self.index_head_dim // 32

    @property
    def window_record_bytes(self) -> int:
        """FP8 window record per token per layer: E4M3 + UE8M0 per 32 channels (528 B)."""
        return self.head_dim + self.head_dim // 32

    @property
    def global_kv_bytes_per_token(self) -> float:
        """Compact global KV moved P->D and prefix-cached: 890 B/token for the released config."""
        total = 0.0
        for s in self.kv_source_layer_ids:
            total += (self.compressed_entry_bytes + self.index_entry_bytes) / self.compress_ratios[s]
        return total

    @property
    def engram_hash_columns(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads


# ---------------------------------------------------------------- from_hf sections
def _shape_fields(t: dict[str, Any]) -> dict[str, Any]:
    """Widths and counts of the backbone (embedding, attention projections, window)."""
    return {
        "vocab_size": int(t["vocab_size"]),
        "hidden_size": int(t["hidden_size"]),
        "num_layers": int(t["num_hidden_layers"]),
        "num_heads": int(t["num_attention_heads"]),
        "head_dim": int(t["head_dim"]),
        "rope_head_dim": int(t["qk_rope_head_dim"]),
        "q_lora_rank": int(t["q_lora_rank"]),
        "o_groups": int(t["o_groups"]),
        "o_lora_rank": int(t["o_lora_rank"]),
        "sliding_window": int(t["sliding_window"]),
        "rms_norm_eps": float(t["rms_norm_eps"]),
        "max_position_embeddings": int(t["max_position_embeddings"]),
    }


def _layer_source_fields(t: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """Compression ratios and the KV / index / candidate source layers (backbone only)."""
    ratios = tuple(int(r) for r in t["compress_ratios"][:n_layers])
    if len(ratios) != n_layers:
        raise ValueError(
            f"compress_ratios has {len(t['compress_ratios'])} entries, need at least num_hidden_layers={n_layers}"
        )
    kv_src = tuple(int(x) for x in t["kv_source_layer_ids"])
    return {
        "compress_ratios": ratios,
        "kv_source_layer_ids": kv_src,
        "index_source_layer_ids": tuple(int(x) for x in t.get("index_source_layer_ids", kv_src)),
        "candidate_source_layer_id": int(t.get("candidate_source_layer_id", kv_src[-1])),
        "candidate_topk_blocks": int(t["candidate_topk_blocks"]),
        "candidate_block_size": int(t["candidate_block_size"]),
        "index_n_heads": int(t["index_n_heads"]),
        "index_head_dim": int(t["index_head_dim"]),
        "index_topk": int(t["index_topk"]),
    }


def _rope_from_hf(t: dict[str, Any]) -> RopeConfig:
    """RoPE bases and YaRN scaling; a missing `rope_scaling` means no YaRN (factor 1)."""
    rs = t.get("rope_scaling") or {}
    if rs and rs.get("type", rs.get("rope_type")) != "yarn":
        raise ValueError(f"rope_scaling.type must be 'yarn', got {rs.get('type')!r}")
    return RopeConfig(
        theta=float(t["rope_theta"]),
        compress_theta=float(t["compress_rope_theta"]),
        yarn_factor=float(rs.get("factor", 1.0)),
        yarn_beta_fast=float(rs.get("beta_fast", 32)),
        yarn_beta_slow=float(rs.get("beta_slow", 1)),
        yarn_original_max_position=int(rs.get("original_max_position_embeddings", t["max_position_embeddings"])),
    )


def _engram_fields(t: dict[str, Any]) -> dict[str, Any]:
    """Engram tables; every key but the pad id is optional (a config without Engram)."""
    if "engram_pad_token_id" in t:
        pad = int(t["engram_pad_token_id"])
    elif "engram_pad_id" in t:
        pad = int(t["engram_pad_id"])
    else:
        raise ValueError("config lacks engram_pad_token_id (or engram_pad_id)")
    return {
        "engram_layer_ids": tuple(int(x) for x in t.get("engram_layer_ids", ())),
        "engram_num_embeddings": tuple(int(x) for x in t.get("engram_num_embeddings", ())),
        "engram_max_ngram_size": int(t.get("engram_max_ngram_size", 4)),
        "engram_n_heads": int(t.get("engram_n_heads", 0)),
        "engram_head_dim": int(t.get("engram_head_dim", 0)),
        "engram_vocab_size": int(t.get("engram_vocab_size", 0)),
        "engram_compressed_vocab_size": int(t.get("engram_compressed_vocab_size", 0)),
        "engram_pad_token_id": pad,
    }


def _moe_and_hc_fields(t: dict[str, Any]) -> dict[str, Any]:
    """Routed/shared experts and the hyper-connection (Sinkhorn) mixing."""
    return {
        "n_routed_experts": int(t["n_routed_experts"]),
        "num_experts_per_tok": int(t["num_experts_per_tok"]),
        "n_shared_experts": int(t["n_shared_experts"]),
        "moe_intermediate_size": int(t["moe_intermediate_size"]),
        "routed_scaling_factor": float(t["routed_scaling_factor"]),
        "norm_topk_prob": bool(t.get("norm_topk_prob", True)),
        "swiglu_limit": float(t["swiglu_limit"]),
        "gate_temp": float(t.get("gate_temp", 1.0)),
        "hc_mult": int(t["hc_mult"]),
        "hc_sinkhorn_iters": int(t["hc_sinkhorn_iters"]),
        "hc_eps": float(t["hc_eps"]),
    }


# ---------------------------------------------------------------- to_hf sections
def _hf_text_config(cfg: ModelConfig) -> dict[str, Any]:
    # Key order is the released file's; sections are concatenated in that order.
    t = {
        **_hf_shape(cfg),
        **_hf_moe(cfg),
        **_hf_norm_and_rope(cfg),
        **_hf_layer_sources(cfg),
        **_hf_hc_and_engram(cfg),
        "num_nextn_predict_layers": 0,
    }
    if cfg.dspark is not None:
        t.update(cfg.dspark.to_hf())
        t["compress_ratios"] += list(cfg.dspark.compress_ratios)
    return t


def _hf_shape(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "model_type": "deepseek_v41_text",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": 1,
        "head_dim": cfg.head_dim,
        "qk_rope_head_dim": cfg.rope_head_dim,
        "q_lora_rank": cfg.q_lora_rank,
        "o_lora_rank": cfg.o_lora_rank,
        "o_groups": cfg.o_groups,
    }


def _hf_moe(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_shared_experts": cfg.n_shared_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "hidden_act": "silu",
        "swiglu_limit": cfg.swiglu_limit,
        "gate_temp": cfg.gate_temp,
    }


def _hf_norm_and_rope(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope.theta,
        "compress_rope_theta": cfg.rope.compress_theta,
        "rope_scaling": {
            "type": "yarn",
            "factor": cfg.rope.yarn_factor,
            "beta_fast": cfg.rope.yarn_beta_fast,
            "beta_slow": cfg.rope.yarn_beta_slow,
            "original_max_position_embeddings": cfg.rope.yarn_original_max_position,
        },
    }


def _hf_layer_sources(cfg: ModelConfig) -> dict[str, Any]:
    """Backbone ratios only; to_hf appends the drafter's tail."""
    return {
        "sliding_window": cfg.sliding_window,
        "compress_ratios": list(cfg.compress_ratios),
        "kv_source_layer_ids": list(cfg.kv_source_layer_ids),
        "index_source_layer_ids": list(cfg.index_source_layer_ids),
        "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_topk,
        "candidate_source_layer_id": cfg.candidate_source_layer_id,
        "candidate_topk_blocks": cfg.candidate_topk_blocks,
        "candidate_block_size": cfg.candidate_block_size,
    }


def _hf_hc_and_engram(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "hc_mult": cfg.hc_mult,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters,
        "hc_eps": cfg.hc_eps,
        "engram_layer_ids": list(cfg.engram_layer_ids),
        "engram_num_embeddings": list(cfg.engram_num_embeddings),
        "engram_max_ngram_size": cfg.engram_max_ngram_size,
        "engram_n_heads": cfg.engram_n_heads,
        "engram_head_dim": cfg.engram_head_dim,
        "engram_vocab_size": cfg.engram_vocab_size,
        "engram_compressed_vocab_size": cfg.engram_compressed_vocab_size,
        "engram_pad_token_id": cfg.engram_pad_token_id,
    }


def _hf_quantization(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(cfg.weight_block_size),
        "scale_fmt": "ue8m0",
        "expert_dtype": "fp4",
    }


def _resolve_layers(cfg: ModelConfig) -> tuple[LayerSpec, ...]:
    kv = sorted(cfg.kv_source_layer_ids)
    idx = sorted(cfg.index_source_layer_ids)
    return tuple(_layer_spec(cfg, layer, kv, idx) for layer in range(cfg.num_layers))


def _layer_role(layer: int, ratio: int, kv: list[int], idx: list[int]) -> LayerRole:
    if ratio == 0:
        return LayerRole.SWA_ONLY
    if layer in kv:
        return LayerRole.FULL
    if layer in idx:
        return LayerRole.REINDEX
    return LayerRole.REUSE


def _layer_spec(cfg: ModelConfig, layer: int, kv: list[int], idx: list[int]) -> LayerSpec:
    """`kv`/`idx`: sorted source layers; a compressed layer reads the latest at or before it."""
    r = cfg.compress_ratios[layer]
    role = _layer_role(layer, r, kv, idx)
    owns_index = role in (LayerRole.FULL, LayerRole.REINDEX)
    has_engram = layer in cfg.engram_layer_ids
    cand = cfg.candidate_source_layer_id
    return LayerSpec(
        layer_id=layer,
        ratio=r,
        role=role,
        kv_src=max(s for s in kv if s <= layer) if r > 0 else None,
        idx_src=max(s for s in idx if s <= layer) if r > 0 else None,
        is_candidate_source=layer == cand,
        uses_candidates=owns_index and layer > cand,
        has_engram=has_engram,
        engram_index=cfg.engram_layer_ids.index(layer) if has_engram else None,
        is_encoder=layer < cand,
    )


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
