"""GpuModel from a checkpoint directory, or with random weights in the released formats.

    load_gpu_model(dir, "cuda")          tensors read on the host, moved to the device in their
                                         checkpoint formats (Engram tables stay in host memory)
    random_gpu_model(cfg, "cuda", seed)  every tensor generated on the device (the `bench`
                                         preset's 59 GB in seconds; nothing written to disk)

kernel_impls: op -> implementation over the Triton defaults (`GpuModel`), e.g. the baseline's
torch references for mHC and the indexer.

Both compile the kernels' decode-size variants before returning (`GpuModel.warmup`, on CUDA).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from flashpd.engine.gpu.forward import GpuModel
from flashpd.engine.gpu.weights import from_checkpoint_tensors, random_checkpoint_tensors
from flashpd.model.config import ModelConfig
from flashpd.model.kv_format import DEFAULT_KV_FORMAT, CompressedKVFormat


def _hasher(cfg: ModelConfig, tokenizer_path: str | None):
    if not cfg.engram_layer_ids:
        return None
    from flashpd.model.engram import EngramHasher

    return EngramHasher.from_tokenizer(cfg, tokenizer_path)


def load_gpu_model(
    checkpoint_dir: str,
    device: str = "cuda",
    compressed_kv_format: CompressedKVFormat | str = DEFAULT_KV_FORMAT,
    warm: bool | None = None,
    kernel_impls: Mapping[str, str] | None = None,
) -> GpuModel:
    from flashpd.model.checkpoint import load_checkpoint

    ckpt = load_checkpoint(checkpoint_dir)
    weights = from_checkpoint_tensors(ckpt.cfg, ckpt.tensors, torch.device(device))
    hasher = _hasher(ckpt.cfg, ckpt.tokenizer_path)
    return _warmed(GpuModel(ckpt.cfg, weights, hasher, compressed_kv_format, kernel_impls=kernel_impls), warm)


def random_gpu_model(
    cfg: ModelConfig,
    device: str = "cuda",
    seed: int = 0,
    compressed_kv_format: CompressedKVFormat | str = DEFAULT_KV_FORMAT,
    decode_graphs: bool | None = None,
    warm: bool | None = None,
    kernel_impls: Mapping[str, str] | None = None,
) -> GpuModel:
    tensors = random_checkpoint_tensors(cfg, seed, torch.device(device))
    weights = from_checkpoint_tensors(cfg, tensors, torch.device(device))
    del tensors
    from flashpd.model.presets import PRESET_NAMES, tokenizer_path

    tokenizer = tokenizer_path(cfg.name) if cfg.name in PRESET_NAMES else None
    model = GpuModel(cfg, weights, _hasher(cfg, tokenizer), compressed_kv_format, decode_graphs, kernel_impls)
    return _warmed(model, warm)


def _warmed(model: GpuModel, warm: bool | None) -> GpuModel:
    """Kernels compiled at load (`GpuModel.warmup`); warm=None: on a CUDA device only (the
    interpreter would take minutes)."""
    if model.device.type == "cuda" if warm is None else warm:
        model.warmup()
    return model
