"""Build an LLMEngine from a checkpoint directory (weights, tokenizer, EOS id).

device "cpu": the reference `Model` (weights dequantised once, torch ops or the dispatcher's
kernels). device "cuda": `engine.gpu.GpuModel` (weights kept in checkpoint formats on the GPU,
Triton kernels, BF16 compute), compiled at load (`GpuModel.warmup`) and then warmed through the
engine in its role (`engine.warmup.warm_up`; FLASHPD_ENGINE_WARMUP=0 skips that part).
"""

from __future__ import annotations

import os

import torch

from flashpd.engine.llm_engine import DTYPES, EngineConfig, LLMEngine
from flashpd.model.kv_format import kv_format

EOS_TOKEN = "<|end_of_sentence|>"


def load_tokenizer(checkpoint_dir: str):
    """The checkpoint's HF `tokenizers` tokenizer, or None when it ships none."""
    from tokenizers import Tokenizer

    path = os.path.join(checkpoint_dir, "tokenizer.json")
    return Tokenizer.from_file(path) if os.path.exists(path) else None


def _grammar(tokenizer, vocab_size: int, eos: int | None, role: str):
    """The grammar backend where tokens are sampled (decode, colocated): guided decoding."""
    if tokenizer is None or role == "prefill":
        return None
    from flashpd.engine.grammar import GrammarBackend

    return GrammarBackend.from_tokenizer(tokenizer, vocab_size, eos)


def load_engine(checkpoint_dir: str, config: EngineConfig) -> LLMEngine:
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    fmt = kv_format(config.kv_format)  # the name, resolved once into the format object
    if config.device == "cpu":
        from flashpd.model.model import load_model

        model = load_model(checkpoint_dir, DTYPES[config.dtype], compressed_kv_format=fmt)
    elif config.device.startswith("cuda"):
        from flashpd.engine.gpu.loading import load_gpu_model

        if config.dtype != "bfloat16":
            raise ValueError(f"dtype {config.dtype!r}: the GPU path computes in bfloat16")
        model = load_gpu_model(checkpoint_dir, config.device, fmt)
    else:
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {config.device!r}")
    tokenizer = load_tokenizer(checkpoint_dir)
    eos = tokenizer.token_to_id(EOS_TOKEN) if tokenizer is not None else None
    torch.manual_seed(config.seed)
    engine = LLMEngine(model, config, eos_token_id=eos,
                       grammar=_grammar(tokenizer, model.cfg.vocab_size, eos, config.role))
    if config.device.startswith("cuda"):  # CPU engines (tests, the demo) start cold
        from flashpd.engine.warmup import warm_up_at_load

        warm_up_at_load(engine)
    return engine
