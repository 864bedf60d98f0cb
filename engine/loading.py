"""Build an LLMEngine from a checkpoint directory (weights, tokenizer, EOS id)."""

from __future__ import annotations

import os

import torch

from flashpd.engine.llm_engine import DTYPES, EngineConfig, LLMEngine

EOS_TOKEN = "<|end_of_sentence|>"


def load_tokenizer(checkpoint_dir: str):
    """The checkpoint's HF `tokenizers` tokenizer, or None when it ships none."""
    from tokenizers import Tokenizer

    path = os.path.join(checkpoint_dir, "tokenizer.json")
    return Tokenizer.from_file(path) if os.path.exists(path) else None


def load_engine(checkpoint_dir: str, config: EngineConfig) -> LLMEngine:
    from flashpd.model.model import load_model

    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    model = load_model(checkpoint_dir, DTYPES[config.dtype],
                       compressed_kv_format=config.kv_format)
    if config.device != "cpu":
        raise ValueError(f"device {config.device!r}: the reference runner runs on cpu only")
    tokenizer = load_tokenizer(checkpoint_dir)
    eos = tokenizer.token_to_id(EOS_TOKEN) if tokenizer is not None else None
    torch.manual_seed(config.seed)
    return LLMEngine(model, config, tokenizer=tokenizer, eos_token_id=eos)
