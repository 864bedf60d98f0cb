"""Fixtures shared across the tree: one random tiny checkpoint per session and its FP32 model."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory) -> str:
    from flashpd.model.checkpoint import write_random_checkpoint
    from flashpd.model.presets import preset_config

    out = tmp_path_factory.mktemp("tiny_engine_ckpt")
    write_random_checkpoint(preset_config("tiny"), str(out), seed=7)
    return str(out)


@pytest.fixture(scope="session")
def model_f32(ckpt_dir):
    from flashpd.model.model import load_model

    return load_model(ckpt_dir, torch.float32)
