"""The `small` preset: every V4.1 layer role at widths that train on ShareGPT in minutes.

Same ten-layer role layout as `tiny` (the table in model/presets/__init__.py: two SWA-only
layers, a ratio-2 block with two KV sources, a ratio-1 block whose first layer is the candidate
source and whose third re-indexes), with widths a real tokenizer and real text need:
hidden 384, 8 query heads x 64 (MQA, one 64-wide latent KV), 8 routed SwiGLU experts (top 2)
plus a shared expert, mHC with 4 streams, Engram 2/3/4-grams x 2 heads, a 6144-token byte-level
BPE trained on the training split (small_tokenizer.json, built by small_tokenizer.py). Window 128
(the engine's chunk) and index top-k 32 of a 64-entry candidate pool bite on ShareGPT turns.
"""

from __future__ import annotations

import os

from flashpd.model.presets import tiny_hf

VOCAB_SIZE = 6144


def small_hf() -> dict:
    """`tiny`'s layer roles (compress ratios, KV/index/candidate sources, Engram layers) at
    trainable widths."""
    hf = tiny_hf()
    hf["text_config"].update(
        vocab_size=VOCAB_SIZE,
        hidden_size=384,
        num_attention_heads=8,
        qk_rope_head_dim=32,
        q_lora_rank=192,
        o_lora_rank=128,
        n_shared_experts=1,
        moe_intermediate_size=256,
        rms_norm_eps=1e-6,
        index_head_dim=64,
        index_topk=32,
        candidate_topk_blocks=16,
        hc_sinkhorn_iters=8,
        engram_head_dim=64,
        engram_vocab_size=3000,
        dspark_markov_rank=64,  # drafter: tiny's layout (taps 7-9, 4 experts top 2), rank 64
    )
    return hf


CHECKPOINT_DIR = os.path.join(os.path.dirname(__file__), "small_checkpoint")


def checkpoint_path() -> str:
    """The trained `small` checkpoint shipped in the repo (`flashpd serve` / `demo` default).

    Rebuild it on a GPU with `flashpd train --preset small --out DIR --minutes 4.6` (H200: ~5 min;
    its train_log.json records the run).
    """
    if not os.path.exists(os.path.join(CHECKPOINT_DIR, "config.json")):
        raise FileNotFoundError(
            f"the small checkpoint is missing from {CHECKPOINT_DIR}; rebuild it "
            "with `flashpd train --preset small --out DIR`"
        )
    return CHECKPOINT_DIR
