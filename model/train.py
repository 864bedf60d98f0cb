"""`flashpd train`: train a preset on ShareGPT conversations and export it in the released format.

    flashpd train --preset small --out checkpoints/small --minutes 4 --device cuda

The serving forward (model/model.py) runs without autograd over per-sequence states. Training
needs the same function of the weights with gradients over whole sequences, so this module
builds it from the model's public pieces: the config's layer roles, the checkpoint manifest
(parameter names, shapes and formats), the kernel references (mHC, Engram injection, RoPE, the
number formats, the indexer's candidate and top-k rules) and the Engram hasher's tables. It is the
model forward for a batch of sequences that all start at position 0 (every row computed):

    per layer (paper order, model_spec §2.4)
      Engram inject -> attn input = attn_norm(collapse(X, carried pre))
      kv source: compress (ratio 2 gated pooling / ratio 1 projection) -> NVFP4 entries at the
                 group's first position + MXFP4 index keys
      index source: MXFP4 index query, scores, candidates (layer cand), top-k (no gradient)
      attention: one softmax over the window (FP8 window KV, last W positions) and the selected
                 compressed entries, per-head sink; grouped wo_a, wo_b
      expand; FFN mixes; ffn_norm(collapse(X, attention pre)); MoE (routed top-k + shared)
    head: norm(collapse(X, last FFN pre)) . head^T

Weights train in FP32 and are fake-quantised in the forward to their checkpoint formats with
straight-through gradients (FP8 E4M3 32x32 tiles, MXFP4 experts, FP8 Engram rows, BF16), so the
exported checkpoint computes what was trained; activations use the model's fake quants (FP8
window KV, NVFP4 compressed KV, MXFP4 index keys and queries). Two training-only terms: the
indexer learns from a KL loss toward the attention's distribution over the compressed entries
(its inputs detached, as in DeepSeek-V3.2), and MoE routing biases follow the auxiliary-loss-free
rule (bias += rate * sign(mean load - load)). `check_against_model` compares this forward's
logits with the serving forward (Model.forward) on the exported checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from flashpd.kernels.engram import ref as engram_ref
from flashpd.kernels.indexer import ref as indexer_ref
from flashpd.kernels.mhc import ref as mhc
from flashpd.kernels.quant import ref as quant
from flashpd.kernels.rope import ref as rope
from flashpd.model.checkpoint import (
    TensorSpec,
    is_scale,
    logical_shape,
    manifest,
    plan_shards,
    shard_file_names,
    shard_index,
    write_index_and_config,
)
from flashpd.model.config import LayerSpec, ModelConfig

INDEXER_LOSS_WEIGHT = 0.1
BIAS_UPDATE_RATE = 1e-3
MAX_SHARD_BYTES = 15 * 2**20  # each file comes back from the GPU machine (<= 16 MiB)


# ============================================================================ weight formats
def _fq_fp8_block(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    q, s = quant.quantize_fp8_blockwise(w, block)
    return quant.dequantize_fp8_blockwise(q, s, torch.float32, block)


def _fq_mxfp4(w: torch.Tensor) -> torch.Tensor:
    q, s = quant.quantize_mxfp4_weight(w)
    return quant.dequantize_mxfp4_weight(q, s, torch.float32)


def _fq_fp8_rows(w: torch.Tensor) -> torch.Tensor:
    q, s = quant.quantize_fp8_rows(w)
    return quant.dequantize_fp8_rows(q, s, torch.float32)


def _format_of(name: str, spec: TensorSpec) -> str:
    if spec.dtype == "F8_E4M3":
        return "fp8_rows" if name.endswith("engram.embed.weight") else "fp8_block"
    return {"I8": "mxfp4", "BF16": "bf16", "F32": "f32"}[spec.dtype]


def _ste(w: torch.Tensor, fq) -> torch.Tensor:
    """Value fq(w), gradient of the identity (straight-through)."""
    if not torch.is_grad_enabled() or not w.requires_grad:
        return fq(w)
    return w + (fq(w.detach()) - w).detach()


def _act_ste(x: torch.Tensor, fq) -> torch.Tensor:
    """Activation fake quant (the model's) with a straight-through gradient."""
    if not torch.is_grad_enabled() or not x.requires_grad:
        return fq(x)
    return x + (fq(x.detach()) - x).detach()


# ============================================================================ the model
def _key(name: str) -> str:
    return name.replace(".", "__")


def _init(name: str, shape: tuple[int, ...], cfg: ModelConfig, g: torch.Generator) -> torch.Tensor:
    leaf = name.split(".", 2)[-1] if name.startswith("layers.") else name
    s = cfg.hc_mult
    if leaf.endswith("norm.weight") or leaf in ("engram.q_weight", "engram.k_weight"):
        return torch.ones(shape)
    if leaf in ("attn.attn_sink", "ffn.gate.bias", "ffn.gate.bias_vl"):
        return torch.zeros(shape)
    if leaf.endswith("_fn"):
        return torch.randn(shape, generator=g) * 1e-3
    if leaf.endswith("_scale"):
        return torch.ones(shape)
    if leaf.endswith("_base"):  # pre 0 (0.5 each), post 0 (1 each), comb near the identity
        base = torch.zeros(shape)
        base[2 * s :] = (torch.eye(s) * 4.0).reshape(-1)
        return base
    if leaf == "embed.weight":
        return torch.randn(shape, generator=g)
    if leaf == "engram.embed.weight":
        return torch.randn(shape, generator=g) * 0.5
    std = shape[-1] ** -0.5
    if leaf.endswith(("wo_b.weight", "w2.weight")) or leaf == "head.weight":
        std /= math.sqrt(2 * cfg.num_layers) if leaf != "head.weight" else 1.0
    return torch.randn(shape, generator=g) * std


class TrainModel(torch.nn.Module):
    """FP32 master weights named as the checkpoint manifest; forward = the model's (see module)."""

    def __init__(self, cfg: ModelConfig, hasher=None, seed: int = 0):
        super().__init__()
        if cfg.engram_layer_ids and hasher is None:
            raise ValueError("config has Engram layers: an EngramHasher is required")
        self.cfg, self.hasher = cfg, hasher
        g = torch.Generator().manual_seed(seed)
        self.specs = {n: s for n, s in manifest(cfg).items() if not is_scale(s)}
        self.formats = {n: _format_of(n, s) for n, s in self.specs.items()}
        self.params = torch.nn.ParameterDict(
            {_key(n): torch.nn.Parameter(_init(n, logical_shape(s), cfg, g)) for n, s in self.specs.items()}
        )
        self.compute_dtype = torch.float32
        yarn = rope.Yarn(
            cfg.rope.yarn_factor, cfg.rope.yarn_beta_fast, cfg.rope.yarn_beta_slow, cfg.rope.yarn_original_max_position
        )
        self.register_buffer(
            "freqs_main", rope.rope_frequencies(cfg.rope_head_dim, cfg.rope.theta, None), persistent=False
        )
        self.register_buffer(
            "freqs_compress", rope.rope_frequencies(cfg.rope_head_dim, cfg.rope.compress_theta, yarn), persistent=False
        )
        self.expert_load: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ weights
    def raw(self, name: str) -> torch.Tensor:
        return self.params[_key(name)]

    def w(self, name: str) -> torch.Tensor:
        """The weight as the exported checkpoint holds it (FP32 values, STE gradient)."""
        p, fmt = self.raw(name), self.formats[name]
        if fmt == "f32":
            return p
        if fmt == "bf16":
            return _ste(p, lambda t: t.to(torch.bfloat16).to(torch.float32))
        if fmt == "fp8_block":
            return _ste(p, lambda t: _fq_fp8_block(t, self.cfg.weight_block_size))
        if fmt == "mxfp4":
            return _ste(p, _fq_mxfp4)
        return _ste(p, _fq_fp8_rows)

    def wc(self, name: str) -> torch.Tensor:
        return self.w(name).to(self.compute_dtype)

    # ------------------------------------------------------------------ small ops
    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x.to(self.compute_dtype), self.wc(name))

    def _lin32(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x.float(), self.w(name))

    def _rms(self, x: torch.Tensor, name: str | None) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        if name is not None:
            y = y * self.w(name)
        return y.to(x.dtype)

    # ------------------------------------------------------------------ forward
    def forward(self, ids: torch.Tensor, want_aux: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, T] (every sequence from position 0) -> (logits FP32 [B, T, V], indexer loss)."""
        cfg, dt = self.cfg, self.compute_dtype
        b, t = ids.shape
        if t % 2:
            raise ValueError(f"sequence length {t} must be even (ratio-2 groups)")
        n = b * t
        pos = torch.arange(t, device=ids.device)
        cs_main = rope.rope_cos_sin(pos, self.freqs_main)
        cs_comp = rope.rope_cos_sin(pos, self.freqs_compress)
        hash_rows = self._engram_rows(ids) if cfg.engram_layer_ids else {}
        streams = self.wc("embed.weight")[ids.reshape(-1)]  # [N, D]
        streams = streams[:, None, :].expand(n, cfg.hc_mult, cfg.hidden_size).contiguous()
        carried = torch.zeros(n, cfg.hc_mult, device=ids.device)
        carried[:, 0] = 1.0
        ctx = _Ctx(b, t, pos, cs_main, cs_comp, want_aux)
        self.expert_load = {}
        for spec in cfg.layers:
            streams, carried = self._layer(spec, streams, carried, hash_rows, ctx)
        h = self._rms(mhc.collapse(streams, carried), "norm.weight")
        logits = F.linear(h.to(dt), self.wc("head.weight")).float()
        aux = torch.stack(ctx.aux).sum() if ctx.aux else torch.zeros((), device=ids.device)
        return logits.reshape(b, t, -1), aux

    def _engram_rows(self, ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """Engram row ids [B, T, C] per Engram layer: the hasher's rule (§8.4), batched."""
        hz, dev = self.hasher, ids.device
        cmap = hz.compressed_map.to(dev)[ids]  # [B, T]
        k = hz.max_shift
        padded = torch.cat((torch.full((ids.shape[0], k), hz.pad_id, device=dev, dtype=torch.long), cmap), 1)
        shifted = torch.stack([padded[:, k - s : k - s + ids.shape[1]] for s in range(k + 1)], -1)
        out = {}
        for spec in self.cfg.layers:
            if not spec.has_engram:
                continue
            i = spec.engram_index
            prod = shifted * hz.multipliers[i].to(dev)  # [B, T, K]
            rolling, hashes = prod[..., :1], []
            for s in range(1, k + 1):
                rolling = torch.bitwise_xor(rolling, prod[..., s : s + 1])
                hashes.append(rolling)
            r = torch.cat(hashes, -1)  # [B, T, n_grams]
            rows = torch.remainder(r[..., None], hz.primes[i].to(dev)) + hz.offsets[i].to(dev)
            out[spec.layer_id] = rows.reshape(*ids.shape, -1)
        return out

    def _mixes(self, xs: torch.Tensor, p: str, site: str):
        return mhc.hc_mixes(
            xs,
            self.w(f"{p}hc_{site}_fn"),
            self.w(f"{p}hc_{site}_base"),
            self.w(f"{p}hc_{site}_scale"),
            self.cfg.hc_sinkhorn_iters,
            self.cfg.hc_eps,
            self.cfg.rms_norm_eps,
        )

    def _layer(self, spec: LayerSpec, xs, carried, hash_rows, ctx):
        cfg, p = self.cfg, f"layers.{spec.layer_id}."
        if spec.has_engram:
            rows = hash_rows[spec.layer_id].reshape(xs.shape[0], -1)  # [N, C]
            table = self.wc(p + "engram.embed.weight")[rows].reshape(rows.shape[0], -1)
            qk = self.w(p + "engram.q_weight") * self.w(p + "engram.k_weight")
            xs = engram_ref.engram_inject(xs, table, self.wc(p + "engram.wkv.weight"), qk, cfg.rms_norm_eps)
        x = self._rms(mhc.collapse(xs, carried), p + "attn_norm.weight")  # [N, D]
        if spec.owns_compressor:
            self._compress(spec, p, x, ctx)
        pre_a, post_a, comb_a = self._mixes(xs, p, "attn")
        y = self._attention(spec, p, x, ctx)
        xs = mhc.expand(y, xs, post_a, comb_a)
        pre_f, post_f, comb_f = self._mixes(xs, p, "ffn")
        h = self._rms(mhc.collapse(xs, pre_a), p + "ffn_norm.weight")
        xs = mhc.expand(self._moe(spec, p, h), xs, post_f, comb_f)
        return xs, pre_f

    # ------------------------------------------------------------------ compressor (§4, §5.2)
    def _compress(self, spec: LayerSpec, p: str, x: torch.Tensor, ctx) -> None:
        latent = self._compressed_latent(spec, p, x, ctx)  # [B, G, d]
        n_ent = latent.shape[1]
        entry_pos = torch.arange(n_ent, device=x.device) * spec.ratio
        cos, sin = rope.rope_cos_sin(entry_pos, self.freqs_compress)
        flat = latent.transpose(0, 1)  # [G, B, d]: rotate takes the position axis first
        kv = rope.rotate(flat, cos, sin).transpose(0, 1)
        kv = _act_ste(kv, quant.fake_quant_nvfp4)

        def keys_of(lat):
            k = self._rms(self._lin(lat, p + "attn.indexer.wk.weight"), p + "attn.indexer.k_norm.weight")
            k = rope.rotate(k.transpose(0, 1), cos, sin).transpose(0, 1)
            return _act_ste(k, quant.fake_quant_mxfp4)

        ctx.entries[spec.layer_id] = kv  # [B, G, d]
        ctx.keys[spec.layer_id] = keys_of(latent.detach())  # gradient: the indexer loss only

    def _compressed_latent(self, spec: LayerSpec, p: str, x: torch.Tensor, ctx) -> torch.Tensor:
        """Ratio 2: gated softmax pooling of token pairs (FP32); ratio 1: one entry per token."""
        b, t = ctx.b, ctx.t
        if spec.ratio == 2:
            a = self._lin32(x, p + "attn.compressor.wkv.weight").reshape(b, t // 2, 2, -1)
            g = self._lin32(x, p + "attn.compressor.wgate.weight").reshape(b, t // 2, 2, -1)
            wts = torch.softmax(g, dim=2)
            pooled = (wts * a).sum(2)  # [B, G, d] FP32
            return self._rms(pooled.to(self.compute_dtype), p + "attn.compressor.norm.weight")
        per_token = self._lin(x, p + "attn.compressor.wkv.weight")
        return self._rms(per_token, p + "attn.compressor.norm.weight").reshape(b, t, -1)

    # ------------------------------------------------------------------ attention (§3, §5)
    def _attention(self, spec: LayerSpec, p: str, x: torch.Tensor, ctx) -> torch.Tensor:
        cfg, dt, b, t = self.cfg, self.compute_dtype, ctx.b, ctx.t
        nh, d = cfg.num_heads, cfg.head_dim
        cos, sin = ctx.cs_comp if spec.ratio > 0 else ctx.cs_main
        cos_n, sin_n = cos.repeat(b, 1), sin.repeat(b, 1)  # rows of [N] are (b, t)
        c_q = self._rms(self._lin(x, p + "attn.wq_a.weight"), p + "attn.q_norm.weight")
        q = self._lin(c_q, p + "attn.wq_b.weight").reshape(b * t, nh, d)
        q = rope.rotate(q, cos_n, sin_n).reshape(b, t, nh, d)
        kv = self._rms(self._lin(x, p + "attn.wkv.weight"), p + "attn.kv_norm.weight")
        kv = _act_ste(rope.rotate(kv, cos_n, sin_n), quant.fake_quant_fp8_ue8m0).reshape(b, t, d)
        keys, mask = kv, ctx.window_mask(cfg.sliding_window)[None].expand(b, t, t)
        if spec.ratio > 0:
            if spec.owns_index_query:
                self._select(spec, p, x, c_q, (cos_n, sin_n), q, ctx)
            entries = ctx.entries[spec.kv_src]  # [B, N, d]
            keys = torch.cat((kv, entries), 1)
            mask = torch.cat((mask, ctx.selected[spec.idx_src]), 2)
        scores = torch.einsum("bthd,bsd->bhts", q, keys.to(q.dtype)).float() * d**-0.5
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        sink = self.w(p + "attn.attn_sink").reshape(1, nh, 1, 1).expand(b, nh, t, 1)
        probs = torch.softmax(torch.cat((scores, sink), -1), -1)[..., :-1]
        o = torch.einsum("bhts,bsd->bthd", probs.to(dt), keys.to(dt)).reshape(b * t, nh, d)
        o = rope.rotate(o, cos_n, sin_n, inverse=True)
        groups = o.reshape(b * t, cfg.o_groups, -1)
        wo_a = self.wc(p + "attn.wo_a.weight").reshape(cfg.o_groups, cfg.o_lora_rank, -1)
        z = torch.einsum("ngi,gri->ngr", groups, wo_a).reshape(b * t, -1)
        return self._lin(z, p + "attn.wo_b.weight")

    def _select(self, spec: LayerSpec, p: str, x, c_q, cos_sin, q_main, ctx) -> None:
        """Index scores of this layer's query over kv_src's keys; candidates; top-k mask."""
        scores, visible = self._index_scores(spec, p, x, c_q, cos_sin, ctx)
        self._select_topk(spec, scores.detach(), ctx)
        if ctx.want_aux:
            ctx.aux.append(self._indexer_loss(scores, q_main, ctx.entries[spec.kv_src], visible))

    def _index_scores(self, spec: LayerSpec, p: str, x, c_q, cos_sin, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """Index scores [B, T, N] (-inf where not yet visible) and the visibility mask [T, N]."""
        cfg, b, t = self.cfg, ctx.b, ctx.t
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        qi = self._lin(c_q.detach(), p + "attn.indexer.wq_b.weight").reshape(b * t, hi, di)
        qi = _act_ste(rope.rotate(qi, *cos_sin), quant.fake_quant_mxfp4).reshape(b, t, hi, di)
        scale = di**-0.5 * hi**-0.5
        head_w = self._lin(x.detach(), p + "attn.indexer.weights_proj.weight").float() * scale
        keys = ctx.keys[spec.kv_src]  # [B, N, dI]
        dots = torch.einsum("bthd,bnd->bthn", qi.float(), keys.float()).clamp_min(0)
        scores = (head_w.reshape(b, t, hi, 1) * dots).sum(2)  # [B, T, N]
        n_visible = (ctx.pos + 1) // spec.ratio  # [T]
        visible = torch.arange(keys.shape[1], device=x.device)[None, :] < n_visible[:, None]  # [T, N]
        return scores.masked_fill(~visible[None], float("-inf")), visible

    @torch.no_grad()
    def _select_topk(self, spec: LayerSpec, scores: torch.Tensor, ctx) -> None:
        """ctx.selected[layer]: [B, T, N] top-k mask (within the candidate pool on decoder layers)."""
        cfg, b, t = self.cfg, ctx.b, ctx.t
        n_keys = scores.shape[-1]
        flat = scores.reshape(b * t, n_keys)
        nv = ((ctx.pos + 1) // spec.ratio).repeat(b)
        if spec.is_candidate_source:
            ctx.candidates = indexer_ref.candidate_mask(flat, nv, cfg.candidate_block_size, cfg.candidate_topk_blocks)
        allowed = ctx.candidates if spec.uses_candidates else None
        top = indexer_ref.select_topk(flat, cfg.index_topk, allowed)  # [B*T, K]
        sel = torch.zeros(b * t, n_keys + 1, dtype=torch.bool, device=scores.device)
        sel.scatter_(1, torch.where(top < 0, n_keys, top), True)
        ctx.selected[spec.layer_id] = sel[:, :n_keys].reshape(b, t, n_keys)

    def _indexer_loss(self, scores, q_main, entries, visible) -> torch.Tensor:
        """KL(attention over all visible entries (heads averaged) || softmax(index scores))."""
        with torch.no_grad():
            att = torch.einsum("bthd,bnd->bhtn", q_main.float(), entries.float())
            att = att * self.cfg.head_dim**-0.5
            att = att.masked_fill(~visible[None, None], float("-inf"))
            target = torch.softmax(att, -1).nan_to_num(0.0).mean(1)  # [B, T, N]
        rows = visible.any(-1)  # queries with at least one visible entry
        logq = torch.log_softmax(scores[:, rows], -1).masked_fill(~visible[None, rows], 0.0)
        tgt = target[:, rows]
        kl = (tgt * (torch.log(tgt.clamp_min(1e-12)) - logq)).sum(-1)
        return kl.mean() * INDEXER_LOSS_WEIGHT

    # ------------------------------------------------------------------ MoE (§7)
    def _moe(self, spec: LayerSpec, p: str, h: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        logits = self._lin32(h, p + "ffn.gate.weight") / cfg.gate_temp
        scores = torch.sqrt(F.softplus(logits))
        biased = scores.detach() + self.w(p + "ffn.gate.bias").detach()
        ids = torch.topk(biased, cfg.num_experts_per_tok, dim=-1).indices  # [N, k]
        chosen = torch.gather(scores, 1, ids)
        if cfg.norm_topk_prob:
            chosen = chosen / (chosen.sum(-1, keepdim=True) + 1e-20)
        weights = chosen * cfg.routed_scaling_factor
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        with torch.no_grad():
            self.expert_load[spec.layer_id] = torch.bincount(ids.reshape(-1), minlength=cfg.n_routed_experts).float()
        for e in range(cfg.n_routed_experts):
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            y = self._expert(h[tok], f"{p}ffn.experts.{e}.", weights[tok, slot][:, None])
            out = out.index_add(0, tok, y.float())
        if cfg.n_shared_experts:
            out = out + self._expert(h, f"{p}ffn.shared_experts.", None).float()
        return out.to(h.dtype)

    def _expert(self, x, pfx: str, weight) -> torch.Tensor:
        lim = self.cfg.swiglu_limit
        gate = self._lin(x, pfx + "w1.weight").float().clamp_max(lim)
        up = self._lin(x, pfx + "w3.weight").float().clamp(-lim, lim)
        hdn = F.silu(gate) * up
        if weight is not None:
            hdn = weight * hdn
        return self._lin(hdn.to(self.compute_dtype), pfx + "w2.weight")

    @torch.no_grad()
    def update_routing_bias(self, rate: float = BIAS_UPDATE_RATE) -> None:
        """Auxiliary-loss-free balancing: raise the bias of under-loaded experts."""
        for layer, load in self.expert_load.items():
            bias = self.raw(f"layers.{layer}.ffn.gate.bias")
            bias += rate * torch.sign(load.mean() - load)


class _Ctx:
    """Per-forward state: entries/keys per kv source, selections, candidates, aux losses."""

    def __init__(self, b, t, pos, cs_main, cs_comp, want_aux):
        self.b, self.t, self.pos = b, t, pos
        self.cs_main, self.cs_comp, self.want_aux = cs_main, cs_comp, want_aux
        self.entries: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.selected: dict[int, torch.Tensor] = {}
        self.candidates: torch.Tensor | None = None
        self.aux: list[torch.Tensor] = []
        self._window: torch.Tensor | None = None

    def window_mask(self, w: int) -> torch.Tensor:
        if self._window is None:
            diff = self.pos[:, None] - self.pos[None, :]
            self._window = (diff >= 0) & (diff < w)  # [T, T]
        return self._window


# ============================================================================ export
def export_checkpoint(
    model: TrainModel, out_dir: str, tokenizer_path: str | None, max_shard_bytes: int = MAX_SHARD_BYTES
) -> list[str]:
    """Write the weights in the released format (manifest order, config.json, index, tokenizer)."""
    from safetensors.torch import save_file

    cfg = model.cfg
    specs = manifest(cfg)
    tensors = export_tensors(cfg, specs, model.raw, model.formats)
    os.makedirs(out_dir, exist_ok=True)
    shards = plan_shards(specs, max_shard_bytes)
    files = shard_file_names("model", len(shards))
    for file, names in zip(files, shards, strict=True):
        save_file({n: tensors[n] for n in names}, os.path.join(out_dir, file), metadata={"format": "pt"})
    write_index_and_config(out_dir, cfg, shard_index(specs, files, shards))
    if tokenizer_path:
        shutil.copyfile(tokenizer_path, os.path.join(out_dir, "tokenizer.json"))
    return [os.path.join(out_dir, f) for f in files]


def export_tensors(
    cfg: ModelConfig, specs: dict[str, TensorSpec], raw, formats: dict[str, str]
) -> dict[str, torch.Tensor]:
    """Master weights (`raw(name)`, FP32) -> checkpoint tensors in their formats (+ scales),
    checked against `specs`."""
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, spec in specs.items():
            if not is_scale(spec):
                tensors.update(_export_one(cfg, name, raw(name).detach().float().cpu(), formats[name]))
    for name, spec in specs.items():
        got = tensors[name]
        if tuple(got.shape) != spec.shape:
            raise RuntimeError(f"{name}: exported shape {tuple(got.shape)} != {spec.shape}")
    return tensors


def _export_one(cfg: ModelConfig, name: str, w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """One FP32 master weight in its checkpoint format; quantized ones bring their `.scale`."""
    if fmt == "bf16":
        return {name: w.to(torch.bfloat16).contiguous()}
    if fmt not in ("fp8_block", "fp8_rows", "mxfp4"):
        return {name: w.contiguous()}
    if fmt == "fp8_block":
        q, s = quant.quantize_fp8_blockwise(w, cfg.weight_block_size)
    elif fmt == "fp8_rows":
        q, s = quant.quantize_fp8_rows(w)
    else:
        q, s = quant.quantize_mxfp4_weight(w)
        q = q.view(torch.int8)
    return {name: q.contiguous(), name[: -len(".weight")] + ".scale": s.view(torch.float8_e8m0fnu)}


def check_against_model(model: TrainModel, ckpt_dir: str, ids: list[int]) -> float:
    """Max |logit difference| between this forward (FP32) and Model.forward on the export."""
    from flashpd.model.model import LogitsRequest, SeqPlan, load_model

    served = load_model(ckpt_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = served.run(served.new_state(), ids, SeqPlan(logits=LogitsRequest.ALL))
        dev = next(model.parameters()).device
        ours, _ = model(torch.tensor([ids], device=dev))
    return float((ref.float().cpu() - ours[0].float().cpu()).abs().max())


# ============================================================================ data
@dataclass
class Batches:
    """Fixed-length training rows: each starts with BOS; pad-filled tails carry no loss."""

    rows: torch.Tensor  # [R, T] int64

    def sample(self, batch: int, gen: torch.Generator) -> torch.Tensor:
        idx = torch.randint(0, self.rows.shape[0], (batch,), generator=gen)
        return self.rows[idx]


def make_rows(token_lists: list[list[int]], seq_len: int, bos: int, pad: int) -> torch.Tensor:
    """Cut each conversation into rows of seq_len tokens; continuation rows restart with BOS."""
    rows = []
    for ids in token_lists:
        start, first = 0, True
        while start < len(ids) - 1:
            take = seq_len if first else seq_len - 1
            chunk = ids[start : start + take]
            if not first:
                chunk = [bos] + chunk
            start += take
            first = False
            if len(chunk) < 16:
                break
            rows.append(chunk + [pad] * (seq_len - len(chunk)))
    if not rows:
        return torch.zeros(0, seq_len, dtype=torch.long)
    return torch.tensor(rows, dtype=torch.long)


def loss_fn(logits: torch.Tensor, ids: torch.Tensor, pad: int) -> tuple[torch.Tensor, int]:
    """Mean next-token cross entropy over non-pad targets; (loss, target count)."""
    tgt = ids[:, 1:]
    lg = logits[:, :-1].reshape(-1, logits.shape[-1])
    mask = (tgt != pad).reshape(-1)
    loss = F.cross_entropy(lg[mask], tgt.reshape(-1)[mask])
    return loss, int(mask.sum())


# ============================================================================ training
def load_preset(preset: str):
    from flashpd.model.engram import EngramHasher
    from flashpd.model.presets import preset_config, tokenizer_path

    cfg = preset_config(preset)
    tok = tokenizer_path(preset)
    hasher = EngramHasher.from_tokenizer(cfg, tok) if cfg.engram_layer_ids else None
    return cfg, tok, hasher


def prepare_data(tokenizer_path: str, seq_len: int, limit: int | None, log, data: str | None = None) -> tuple:
    from tokenizers import Tokenizer

    from flashpd.model import train_data

    t0 = time.time()
    train, held = train_data.split(train_data.load_conversations(data))
    if limit is not None:  # the first `limit` of each split
        train, held = train[:limit], held[:limit]
    tok = Tokenizer.from_file(tokenizer_path)
    bos = tok.token_to_id(train_data.BOS)
    tr_ids = train_data.encode_all(tok, [train_data.chat_text(c) for c in train])
    he_ids = train_data.encode_all(tok, [train_data.chat_text(c) for c in held])
    tr_rows = make_rows(tr_ids, seq_len, bos, train_data.PAD_TOKEN_ID)
    he_rows = make_rows(he_ids, seq_len, bos, train_data.PAD_TOKEN_ID)
    if tr_rows.shape[0] == 0:
        raise ValueError("no training rows: the conversations are too short")
    log(
        f"data: {len(train)} train / {len(held)} held-out conversations, "
        f"{sum(map(len, tr_ids))} / {sum(map(len, he_ids))} tokens, rows {tr_rows.shape[0]} / "
        f"{he_rows.shape[0]} of {seq_len} ({time.time() - t0:.1f} s)"
    )
    return tr_rows, he_rows


@torch.no_grad()
def evaluate(model: TrainModel, rows: torch.Tensor, batch: int, device, pad: int) -> float:
    total, count = 0.0, 0
    for i in range(0, rows.shape[0], batch):
        ids = rows[i : i + batch].to(device)
        logits, _ = model(ids)
        loss, n = loss_fn(logits, ids, pad)
        total += float(loss) * n
        count += n
    return total / max(count, 1)


def train(args) -> dict:
    log = print if not args.quiet else (lambda *a, **k: None)
    device = _setup_torch(args.seed, args.device)
    cfg, tok_path, hasher = load_preset(args.preset)
    tr_rows, he_rows = prepare_data(tok_path, args.seq_len, args.limit_conversations, log, args.data)
    model = TrainModel(cfg, hasher, seed=args.seed).to(device)
    model.compute_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model {cfg.name}: {n_params / 1e6:.1f}M parameters, compute {args.dtype}")
    progress = _train_loop(args, model, _optimizer(model, args.lr), tr_rows, log)
    return _finish(args, model, progress, he_rows[: args.eval_rows], tok_path, log)


def _setup_torch(seed: int, device_name: str) -> torch.device:
    torch.manual_seed(seed)
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return device


def _optimizer(model: TrainModel, lr: float) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices except embeddings; routing biases are not optimized
    (update_routing_bias moves them)."""

    def decays(k: str, p: torch.Tensor) -> bool:
        return p.ndim >= 2 and "embed" not in k

    decay = [p for k, p in model.params.items() if decays(k, p)]
    other = [p for k, p in model.params.items() if not decays(k, p) and not k.endswith(("gate__bias", "gate__bias_vl"))]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def _set_lr(opt: torch.optim.AdamW, args, step: int, frac: float) -> float:
    """Linear warmup over args.warmup steps, then cosine from args.lr down to 0.1 x args.lr
    (`frac`: fraction of the step or time budget spent); sets every group, returns the rate."""
    warm = min(1.0, (step + 1) / args.warmup)
    lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
    for g in opt.param_groups:
        g["lr"] = lr
    return lr


@dataclass
class _Progress:
    """What the training loop hands to the report; losses stay tensors until read once."""

    t0: float  # time.time() at the first step
    steps: int = 0
    first_loss: float | None = None
    last_loss: torch.Tensor | None = None
    history: list[tuple[int, float, float]] = field(default_factory=list)  # (step, loss, indexer)
    train_seconds: float = 0.0  # loop wall time, set by _finish


def _train_loop(args, model: TrainModel, opt: torch.optim.AdamW, rows, log) -> _Progress:
    """Run until args.steps or args.minutes; halve the batch once if the first step runs out of memory."""
    from flashpd.model import train_data

    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(args.seed)
    budget = args.minutes * 60.0 if args.minutes else None
    prog = _Progress(t0=time.time())
    while True:
        elapsed = time.time() - prog.t0
        if (args.steps and prog.steps >= args.steps) or (budget and elapsed >= budget):
            return prog
        lr = _set_lr(opt, args, prog.steps, prog.steps / args.steps if args.steps else elapsed / budget)
        ids = _sample_rows(rows, args.batch, gen).to(device, non_blocking=True)
        try:
            loss, aux = _forward_backward(model, opt, ids, train_data.PAD_TOKEN_ID)
        except torch.OutOfMemoryError:
            if prog.steps or args.batch == 1:
                raise
            loss = aux = None
        if loss is None:  # outside the handler: the traceback no longer holds the step's tensors
            _drop_first_step(opt, log, args)
            continue
        _optimizer_step(model, opt)
        _record_step(args, prog, loss, aux, lr, log)


def _sample_rows(rows, batch: int, gen: torch.Generator) -> torch.Tensor:
    if isinstance(rows, Batches):
        return rows.sample(batch, gen)
    return rows[torch.randint(0, rows.shape[0], (batch,), generator=gen)]


def _forward_backward(
    model: TrainModel, opt: torch.optim.AdamW, ids: torch.Tensor, pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of LM loss + indexer loss; returns both losses (the logits are freed here)."""
    opt.zero_grad(set_to_none=True)
    logits, aux = model(ids, want_aux=True)
    loss, _ = loss_fn(logits, ids, pad)
    (loss + aux).backward()
    return loss, aux


def _drop_first_step(opt: torch.optim.AdamW, log, args) -> None:
    """Out of memory on step 1: free what it allocated and retry at half the batch."""
    opt.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    args.batch //= 2
    log(f"out of memory on the first step: batch -> {args.batch}")


def _optimizer_step(model: TrainModel, opt: torch.optim.AdamW) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    model.update_routing_bias()


def _record_step(args, prog: _Progress, loss: torch.Tensor, aux: torch.Tensor, lr: float, log) -> None:
    """Count the step; read the losses back from the device only on logged steps."""
    prog.steps += 1
    prog.last_loss = loss
    if prog.first_loss is None:
        prog.first_loss = loss.item()
    if prog.steps % args.log_every == 0 or prog.steps == 1:
        prog.history.append((prog.steps, loss.item(), aux.item()))
        log(
            f"step {prog.steps} loss {loss.item():.4f} indexer {aux.item():.4f} lr {lr:.2e} "
            f"{time.time() - prog.t0:.0f} s",
            flush=True,
        )


def _finish(args, model: TrainModel, prog: _Progress, he_rows: torch.Tensor, tok_path: str, log) -> dict:
    """Held-out loss, the exported checkpoint and train_log.json in args.out."""
    from flashpd.model import train_data

    prog.train_seconds = time.time() - prog.t0  # before the held-out pass
    device = next(model.parameters()).device
    heldout = evaluate(model, he_rows, args.batch, device, train_data.PAD_TOKEN_ID) if he_rows.shape[0] else None
    log(
        f"trained {prog.steps} steps in {prog.train_seconds:.0f} s; train loss {prog.first_loss:.3f} -> "
        f"{prog.last_loss.item():.3f}; held-out loss {heldout}"
    )
    files = export_checkpoint(model, args.out, tok_path)
    result = _train_result(args, prog, heldout, files)
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump({k: v for k, v in result.items() if k != "files"}, f, indent=2)
    log(f"wrote {args.out}")
    return result


def _train_result(args, prog: _Progress, heldout: float | None, files: list[str]) -> dict:
    return {
        "steps": prog.steps,
        "train_seconds": prog.train_seconds,
        "first_loss": prog.first_loss,
        "last_loss": prog.last_loss.item(),
        "heldout_loss": heldout,
        "heldout_ppl": math.exp(heldout) if heldout is not None else None,
        "tokens_per_step": args.batch * args.seq_len,
        "files": files,
        "history": prog.history,
    }


def register(sub) -> None:
    p = sub.add_parser("train", help="train a preset on ShareGPT and export a checkpoint")
    _add_training_args(p)
    _add_drafter_args(p)
    p.set_defaults(func=_run)


def _add_training_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="small")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype", default=None, choices=["bf16", "fp32"], help="compute dtype (default bf16 on cuda, fp32 on cpu)"
    )
    p.add_argument("--minutes", type=float, default=None, help="wall-clock training budget")
    p.add_argument("--steps", type=int, default=None, help="training steps (instead of minutes)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit-conversations", type=int, default=None)
    p.add_argument(
        "--data", default=None, help="ShareGPT JSON or .json.gz (default: the bundled dataset; see train_data subset)"
    )
    p.add_argument("--eval-rows", type=int, default=256)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--quiet", action="store_true")


def _add_drafter_args(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group(
        "drafter",
        "--drafter: train the DSpark drafter of a trained checkpoint, its backbone frozen (model/train_drafter.py)",
    )
    d.add_argument("--drafter", action="store_true")
    d.add_argument("--base", default=None, help="trained checkpoint (default: the preset's shipped one)")
    d.add_argument(
        "--teacher-rows", type=int, default=512, help="training rows the frozen backbone labels (taps + greedy tokens)"
    )
    d.add_argument("--blocks-per-row", type=int, default=8)
    d.add_argument(
        "--teacher-source",
        default="text",
        choices=["text", "greedy", "mix"],
        help="teacher rows: ShareGPT text the backbone labels, or a training prompt + the backbone's own greedy "
        "continuation (self-distillation, the text acceptance is measured on), or a mix",
    )
    d.add_argument("--greedy-fraction", type=float, default=0.5, help="--teacher-source mix: the greedy share")
    d.add_argument("--prompt-min", type=int, default=32, help="greedy rows: prompt tokens, at least")
    d.add_argument("--prompt-max", type=int, default=128, help="greedy rows: prompt tokens, at most")
    d.add_argument(
        "--greedy-tokens", type=int, default=None, help="greedy tokens per row (default: seq-len - prompt-max)"
    )
    d.add_argument(
        "--greedy-generator",
        default="auto",
        choices=["auto", "reference", "gpu"],
        help="who generates greedy rows: the FP32 target (reference) or the serving GpuModel (gpu; auto on cuda)",
    )
    d.add_argument("--decode-batch", type=int, default=256, help="greedy rows: sequences per decode forward")
    d.add_argument(
        "--slot-weights",
        default="uniform",
        choices=["uniform", "survival"],
        help="CE weight of draft slot j: 1, or the probability that slots < j are accepted",
    )
    d.add_argument("--eval-prompts", type=int, default=16)
    d.add_argument("--eval-prompt-len", type=int, default=64)
    d.add_argument(
        "--eval-tokens", type=int, default=128, help="greedy tokens per held-out prompt the acceptance length walks"
    )
    d.add_argument("--max-shard-bytes", type=int, default=MAX_SHARD_BYTES)


def _run(args) -> int:
    if not args.steps and not args.minutes:
        raise SystemExit("flashpd train: give --steps or --minutes")
    if args.dtype is None:
        args.dtype = "bf16" if str(args.device).startswith("cuda") else "fp32"
    if args.drafter:
        from flashpd.model.train_drafter import train_drafter

        if args.base is None:
            if args.preset != "small":
                raise SystemExit("flashpd train --drafter: give --base CHECKPOINT")
            from flashpd.model.presets.small import checkpoint_path

            args.base = checkpoint_path()
        train_drafter(args)
        return 0
    train(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashpd train")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["train", *(argv or [])])
    return args.func(args)
