"""Build an LLMEngine from a checkpoint directory (weights, tokenizer, EOS id).

device "cpu": the reference `Model` (weights dequantised once, torch ops or the dispatcher's
kernels). device "cuda": `engine.gpu.GpuModel` (weights kept in checkpoint formats on the GPU,
Triton kernels, BF16 compute), compiled at load (`GpuModel.warmup`) and then warmed through the
engine in its role (`engine.warmup.warm_up`; FLASHPD_ENGINE_WARMUP=0 skips that part).

A checkpoint may also be `random:<preset>[:<seed>]`: the preset's weights in the released
formats, generated on the GPU from the seed (the `bench` preset's 57.8 GB in seconds, nothing
on disk; every process given the same spec on the same kind of GPU holds the same weights).
Its tokenizer is the preset's own, or for a preset that ships none (`bench`), the `small`
preset's byte-level BPE with one added token `<tN>` per id above its vocabulary, so that every
id the model can emit decodes to visible text and any text encodes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from flashpd.engine.llm_engine import DTYPES, EngineConfig, LLMEngine
from flashpd.model.kv_format import kv_format

EOS_TOKEN = "<|end_of_sentence|>"


_RANDOM = re.compile(r"random:(?P<preset>[a-z_]+)(?::(?P<seed>[0-9]{1,9}))?")


@dataclass(frozen=True)
class RandomWeights:
    preset: str
    seed: int


def random_source(checkpoint: str) -> RandomWeights | None:
    """The `random:<preset>[:<seed>]` spec in `checkpoint`, or None for a directory; a
    malformed spec or an unknown preset raises ValueError."""
    if not checkpoint.startswith("random:"):
        return None
    from flashpd.model.presets import PRESET_NAMES

    m = _RANDOM.fullmatch(checkpoint)
    if m is None or m["preset"] not in PRESET_NAMES:
        raise ValueError(
            f"checkpoint {checkpoint!r}: expected random:<preset>[:<seed>] with a preset of {PRESET_NAMES}"
        )
    return RandomWeights(m["preset"], int(m["seed"] or 0))


def model_config(checkpoint: str):
    """The ModelConfig a checkpoint directory or a `random:` spec serves."""
    source = random_source(checkpoint)
    if source is not None:
        from flashpd.model.presets import preset_config

        return preset_config(source.preset)
    from flashpd.model.config import ModelConfig

    return ModelConfig.from_file(checkpoint)


def load_tokenizer(checkpoint_dir: str):
    """The checkpoint's HF `tokenizers` tokenizer, or None when it ships none."""
    from tokenizers import Tokenizer

    source = random_source(checkpoint_dir)
    if source is not None:
        return _preset_tokenizer(source.preset)
    path = os.path.join(checkpoint_dir, "tokenizer.json")
    return Tokenizer.from_file(path) if os.path.exists(path) else None


def _preset_tokenizer(preset: str):
    from tokenizers import AddedToken, Tokenizer

    from flashpd.model.presets import preset_hf, tokenizer_path

    own = tokenizer_path(preset)
    if own is not None:
        return Tokenizer.from_file(own)
    tok = Tokenizer.from_file(tokenizer_path("small"))
    vocab = preset_hf(preset)["text_config"]["vocab_size"]
    tok.add_tokens([AddedToken(f"<t{i}>", special=False, normalized=False) for i in range(tok.get_vocab_size(), vocab)])
    return tok


def _random_gpu_model(source: RandomWeights, config: EngineConfig, fmt):
    if not config.device.startswith("cuda"):
        raise ValueError(
            f"random:{source.preset} weights are generated on the GPU; on the CPU "
            f"write a checkpoint (`flashpd make-checkpoint --preset "
            f"{source.preset}`)"
        )
    from flashpd.engine.gpu.loading import random_gpu_model
    from flashpd.model.presets import preset_config

    cfg = preset_config(source.preset)
    return random_gpu_model(cfg, config.device, source.seed, fmt, kernel_impls=config.kernel_impls)


def _dspark(checkpoint_dir: str, config: EngineConfig, model):
    """The checkpoint's DSpark drafter when the engine speculates with it (its mtp.* tensors,
    read apart from the backbone's), else None."""
    spec = config.speculative
    if spec is None or spec.method != "dspark":
        return None
    if random_source(checkpoint_dir) is not None:
        raise ValueError(
            "speculative.method 'dspark' needs a checkpoint directory with the "
            "drafter's mtp.* tensors (random:<preset> weights have none); use "
            "method 'ngram' for forced-acceptance benchmarks"
        )
    from flashpd.model.checkpoint import load_checkpoint
    from flashpd.model.dspark import DSparkDrafter

    drafter = DSparkDrafter.from_checkpoint(load_checkpoint(checkpoint_dir), model)
    if drafter is None:
        raise ValueError(
            f"speculative.method 'dspark': {checkpoint_dir} has no drafter "
            "(num_nextn_predict_layers = 0 or no mtp.* tensors)"
        )
    return drafter


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
    source = random_source(checkpoint_dir)
    if source is not None:
        if config.dtype != "bfloat16":
            raise ValueError(f"dtype {config.dtype!r}: the GPU path computes in bfloat16")
        model = _random_gpu_model(source, config, fmt)
    elif config.device == "cpu":
        from flashpd.model.model import load_model

        model = load_model(checkpoint_dir, DTYPES[config.dtype], config.kernel_impls, fmt)
    elif config.device.startswith("cuda"):
        from flashpd.engine.gpu.loading import load_gpu_model

        if config.dtype != "bfloat16":
            raise ValueError(f"dtype {config.dtype!r}: the GPU path computes in bfloat16")
        model = load_gpu_model(checkpoint_dir, config.device, fmt, kernel_impls=config.kernel_impls)
    else:
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {config.device!r}")
    tokenizer = load_tokenizer(checkpoint_dir)
    eos = tokenizer.token_to_id(EOS_TOKEN) if tokenizer is not None else None
    torch.manual_seed(config.seed)
    dspark = _dspark(checkpoint_dir, config, model)
    if dspark is None:  # this engine's model is its own: no drafter reads the tap, skip it
        model.tap_layer_ids = ()
    engine = LLMEngine(
        model,
        config,
        eos_token_id=eos,
        grammar=_grammar(tokenizer, model.cfg.vocab_size, eos, config.role),
        dspark=dspark,
    )
    if config.device.startswith("cuda"):  # CPU engines (tests, the demo) start cold
        from flashpd.engine.warmup import warm_up_at_load

        warm_up_at_load(engine)
    return engine
