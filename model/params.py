"""Parameter accounting from the checkpoint manifest (logical elements, scales excluded).

Counting rules:

- Elements are logical: a packed MXFP4 byte (I8) holds two parameters. UE8M0 scale tensors are
  quantisation metadata, not parameters.
- A routed expert is active for a token with probability top-k / n_routed: each token activates
  `num_experts_per_tok` routed experts (plus the shared expert, always).
- An Engram table is touched only through the rows a token hashes to: C = (max_ngram-1)*heads
  rows of engram_head_dim per Engram layer. The projection `engram.wkv` and the gate weights are
  fully active. Likewise the embedding table contributes one row (hidden_size) per token.

Per-token active parameters:

- decode: every layer, plus the embedding row, the final norm and the head.
- prefill (model_spec §11.2): layers 0..cand-1 in full; of the candidate-source layer only what
  writes the global KV for every token: the seam's attn_norm and the layer's compressor
  (wkv, wgate, norm) and index-key path (indexer.wk, k_norm); plus the embedding row. The rest of
  the candidate layer and the later layers run only on the last 128 rows, and no head runs (the
  decode worker samples the first token), so they are not counted.
"""

from __future__ import annotations

import re

from flashpd.model.checkpoint import TensorSpec, is_scale, logical_shape, manifest
from flashpd.model.config import ModelConfig

_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
# Parts of the candidate-source layer that prefill runs on every token.
_SEAM_PARTS = ("attn_norm.weight", "attn.compressor.", "attn.indexer.wk.", "attn.indexer.k_norm.")


def _elements(spec: TensorSpec) -> int:
    n = 1
    for s in logical_shape(spec):
        n *= s
    return n


def _active_elements(cfg: ModelConfig, leaf: str, spec: TensorSpec) -> float:
    """Elements of one layer tensor that a single token touches."""
    if leaf.startswith("ffn.experts."):
        return _elements(spec) * cfg.num_experts_per_tok / cfg.n_routed_experts
    if leaf == "engram.embed.weight":
        return cfg.engram_hash_columns * cfg.engram_head_dim
    return _elements(spec)


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """total_params, active_params_prefill, active_params_decode (see module docstring)."""
    total = 0
    per_layer_active = [0.0] * cfg.num_layers
    seam_active = 0.0
    cand = cfg.candidate_source_layer_id
    for name, spec in manifest(cfg).items():
        if is_scale(spec):
            continue
        total += _elements(spec)
        m = _LAYER_RE.match(name)
        if m is None:
            continue
        layer, leaf = int(m.group(1)), m.group(2)
        active = _active_elements(cfg, leaf, spec)
        per_layer_active[layer] += active
        if layer == cand and leaf.startswith(_SEAM_PARTS):
            seam_active += active
    embed_row = cfg.hidden_size
    final = cfg.hidden_size + cfg.vocab_size * cfg.hidden_size  # norm + head
    prefill = sum(per_layer_active[:cand]) + seam_active + embed_row
    decode = sum(per_layer_active) + embed_row + final
    return {"total_params": total, "active_params_prefill": round(prefill), "active_params_decode": round(decode)}
