"""Floors for the GPU engine benchmark: HBM bytes of a decode step, FLOPs of an encoder prefill.

Laws, not measurements (bench/gpu_engine.py measures the engine's own forward and sets them
beside): a decode step must read every active weight byte and the KV it attends to; an
encoder-path prefill costs 2 FLOP per active parameter per token plus attention and index
scoring.
"""

from __future__ import annotations

import torch

# isort: off
from flashpd.kernels import triton_runtime  # before any kernel import: GPU or interpreter
# isort: on

from flashpd.kernels.quant import ref as qref
from flashpd.kernels.verify import time_ms
from flashpd.model.config import LayerSpec, ModelConfig

PEAK_BF16_TFLOPS = 790.0  # H200 dense bf16 (device notes); MFU is against this


def measure_copy_gbps() -> float:
    """Device copy bandwidth, read + write bytes over time (GB/s)."""
    num = (1 << 30) if not triton_runtime.interpreting() else (1 << 22)
    src = torch.empty(num, dtype=torch.uint8, device=triton_runtime.kernel_device()).random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), 10)
    return 2 * num / (ms * 1e-3) / 1e9


# ============================================================================ byte / FLOP laws
def _fp8_bytes(params: int) -> float:
    return params * (1 + 1 / 1024)  # E4M3 + one UE8M0 per 32x32 tile


def _attn_params(cfg: ModelConfig) -> int:
    d, dim = cfg.head_dim, cfg.hidden_size
    return (
        dim * cfg.q_lora_rank
        + cfg.q_lora_rank * cfg.num_heads * d
        + dim * d
        + cfg.num_heads * d * cfg.o_lora_rank
        + cfg.o_groups * cfg.o_lora_rank * dim
    )


def _expert_params(cfg: ModelConfig) -> int:
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size


def expected_experts(cfg: ModelConfig, batch: int) -> float:
    """Distinct experts a batch touches under uniform routing: E (1 - (1 - k/E)^B)."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return e * (1 - (1 - k / e) ** batch)


def _role_extra_params(cfg: ModelConfig, spec: LayerSpec) -> dict[str, int]:
    """(params, bytes/param) of the compressor / indexer weights a role owns."""
    d, dim, di, nh = cfg.head_dim, cfg.hidden_size, cfg.index_head_dim, cfg.index_n_heads
    out = {}
    if spec.owns_compressor:
        out["compressor_bf16"] = d * dim * (2 if spec.ratio == 2 else 1) + di * d
    if spec.owns_index_query:
        out["index_q_fp8"] = nh * di * cfg.q_lora_rank
        out["index_proj_bf16"] = nh * dim
    return out


def decode_layer_bytes(cfg: ModelConfig, spec: LayerSpec, batch: int, context_tokens: int) -> dict[str, float]:
    """HBM bytes one decode step reads in one layer: weights + KV (activations left out)."""
    s, dim = cfg.hc_mult, cfg.hidden_size
    extra = _role_extra_params(cfg, spec)
    weights = (
        _fp8_bytes(_attn_params(cfg))
        + cfg.n_routed_experts * dim * 2
        + expected_experts(cfg, batch) * _expert_params(cfg) * (0.5 + 1 / 32)
        + _fp8_bytes(_expert_params(cfg))
        + 2 * (2 + s) * s * s * dim * 4
        + 2 * extra.get("compressor_bf16", 0)
        + _fp8_bytes(extra.get("index_q_fp8", 0))
        + 2 * extra.get("index_proj_bf16", 0)
    )
    if spec.has_engram:
        weights += _fp8_bytes((s + 1) * dim * cfg.engram_hash_columns * cfg.engram_head_dim)
    kv = cfg.sliding_window * qref.window_fp8_record_bytes(cfg.head_dim)
    if spec.ratio:
        visible = (context_tokens + 1) // spec.ratio
        kv += min(cfg.index_topk, visible) * qref.nvfp4_record_bytes(cfg.head_dim)
        if spec.owns_index_query:
            pool = cfg.candidate_topk_blocks * cfg.candidate_block_size
            scanned = min(visible, pool) if spec.uses_candidates else visible
            kv += scanned * qref.mxfp4_record_bytes(cfg.index_head_dim)
    return {"weights": weights, "kv": kv * batch}


def decode_step_bytes(cfg: ModelConfig, batch: int, context_tokens: int) -> dict[str, float]:
    total = {"weights": 2.0 * cfg.vocab_size * cfg.hidden_size, "kv": 0.0}  # BF16 head
    for spec in cfg.layers:
        part = decode_layer_bytes(cfg, spec, batch, context_tokens)
        total["weights"] += part["weights"]
        total["kv"] += part["kv"]
    return total


def encoder_prefill_flops(cfg: ModelConfig, num_tokens: int) -> dict[str, float]:
    """2 FLOP per active param per token (+ per compressed entry) plus attention and index
    scoring FLOPs, for layers before the candidate source and that layer's KV-source work."""
    s, dim, d = cfg.hc_mult, cfg.hidden_size, cfg.head_dim
    seam = cfg.candidate_source_layer_id
    mhc_params = 2 * (2 + s) * s * s * dim
    dense_per_token = 0.0
    attn_flops = 0.0
    index_flops = 0.0
    for spec in cfg.layers[:seam]:
        per_token = (
            _attn_params(cfg)
            + cfg.n_routed_experts * dim
            + mhc_params
            + (cfg.num_experts_per_tok + 1) * _expert_params(cfg)
        )
        extra = _role_extra_params(cfg, spec)
        if spec.owns_compressor:  # projections per token; index keys per entry
            per_token += d * dim * (2 if spec.ratio == 2 else 1)
            per_token += cfg.index_head_dim * d / spec.ratio
        per_token += extra.get("index_q_fp8", 0) + extra.get("index_proj_bf16", 0)
        if spec.has_engram:
            per_token += (s + 1) * dim * cfg.engram_hash_columns * cfg.engram_head_dim
        dense_per_token += per_token
        for p in range(num_tokens):
            keys = min(p + 1, cfg.sliding_window)
            if spec.ratio:
                visible = (p + 1) // spec.ratio
                keys += min(cfg.index_topk, visible)
                if spec.owns_index_query:
                    index_flops += 2 * cfg.index_n_heads * cfg.index_head_dim * visible
            attn_flops += 4 * cfg.num_heads * d * keys
    dense_per_token += mhc_params / 2 + d * dim + cfg.index_head_dim * d  # layer-20 seam
    return {
        "dense": 2 * dense_per_token * num_tokens,
        "attention": attn_flops,
        "index": index_flops,
        "active_params_per_token": dense_per_token,
    }
