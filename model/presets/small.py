"""The `small` preset: every V4.1 layer role at widths that train on ShareGPT in minutes.

Same ten-layer role layout as `tiny` (two SWA-only layers, a ratio-2 block with two KV sources,
a ratio-1 block whose first layer is the candidate source and whose third re-indexes), with
widths a real tokenizer and real text need:

    layer  ratio role                 extra
    0      0     SWA-only
    1      0     SWA-only             Engram
    2      2     Full (kv source)
    3      2     Reuse
    4      2     Full (kv source)     Engram
    5      2     Reuse
    6      1     Full, candidate src  (encoder = layers 0..5)
    7      1     Reuse
    8      1     Reindex              candidate-masked
    9      1     Reuse

hidden 384, 8 query heads x 64 (MQA, one 64-wide latent KV), 8 routed SwiGLU experts (top 2)
plus a shared expert, mHC with 4 streams, Engram 2/3/4-grams x 2 heads, a 6144-token byte-level
BPE trained on the training split (small_tokenizer.json, built by small_tokenizer.py). Window 128
(the engine's chunk) and index top-k 32 of a 64-entry candidate pool bite on ShareGPT turns.
"""

from __future__ import annotations

import os

from flashpd.model.presets import released_hf

VOCAB_SIZE = 6144


def small_hf() -> dict:
    hf = released_hf()
    t = hf["text_config"]
    t.update(
        vocab_size=VOCAB_SIZE,
        hidden_size=384,
        num_hidden_layers=10,
        num_attention_heads=8,
        head_dim=64,
        qk_rope_head_dim=32,
        q_lora_rank=192,
        o_lora_rank=128,
        o_groups=2,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=256,
        rms_norm_eps=1e-6,
        max_position_embeddings=65536,
        rope_scaling={"type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": 4096},
        sliding_window=128,
        compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0],
        kv_source_layer_ids=[2, 4, 6],
        index_source_layer_ids=[2, 4, 6, 8],
        index_n_heads=4,
        index_head_dim=64,
        index_topk=32,
        candidate_source_layer_id=6,
        candidate_topk_blocks=16,
        candidate_block_size=4,
        hc_sinkhorn_iters=8,
        engram_layer_ids=[1, 4],
        engram_max_ngram_size=4,
        engram_n_heads=2,
        engram_head_dim=64,
        engram_vocab_size=3000,
        num_nextn_predict_layers=0,
    )
    # Engram table sizes and the compressed vocabulary come from the shipped tokenizer and the
    # prime schedule (model/engram.py fills them in through preset_config("small")).
    t["engram_num_embeddings"] = [0, 0]
    t["engram_compressed_vocab_size"] = 0
    hf["image_token_id"] = None
    return hf


CHECKPOINT_DIR = os.path.join(os.path.dirname(__file__), "small_checkpoint")


def checkpoint_path() -> str:
    """The trained `small` checkpoint shipped in the repo (`flashpd serve` / `demo` default).

    Rebuild it on a GPU with `flashpd train --preset small --out DIR --minutes 4.6` (H200: ~5 min;
    its train_log.json records the run).
    """
    if not os.path.exists(os.path.join(CHECKPOINT_DIR, "config.json")):
        raise FileNotFoundError(f"the small checkpoint is missing from {CHECKPOINT_DIR}; rebuild it "
                                "with `flashpd train --preset small --out DIR`")
    return CHECKPOINT_DIR
