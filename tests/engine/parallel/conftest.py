"""Fixtures of the parallel tests: tiny checkpoints (one that TP4 can split) and FP32 models."""

from __future__ import annotations

import pytest
import torch

from flashpd.model.checkpoint import load_checkpoint, write_random_checkpoint
from flashpd.model.presets import preset_config


def tp4_config():
    """The tiny preset widened so that TP4 splits it: 4 output groups, 128 expert rows."""
    return preset_config("tiny").replace(o_groups=4, moe_intermediate_size=128)


@pytest.fixture(scope="session")
def tp4_ckpt_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tiny_tp4_ckpt")
    write_random_checkpoint(tp4_config(), str(out), seed=11)
    return str(out)


@pytest.fixture(scope="session")
def tiny_tensors(ckpt_dir) -> dict[str, torch.Tensor]:
    return load_checkpoint(ckpt_dir).tensors


@pytest.fixture(scope="session")
def tp4_tensors(tp4_ckpt_dir) -> dict[str, torch.Tensor]:
    return load_checkpoint(tp4_ckpt_dir).tensors


@pytest.fixture(scope="session")
def tp4_model_f32(tp4_ckpt_dir):
    from flashpd.model.model import load_model

    return load_model(tp4_ckpt_dir, torch.float32)
