"""Shared fixtures for the model tests: the session's random tiny checkpoint, an FP32 model."""

from __future__ import annotations

import pytest
import torch

from flashpd.model.checkpoint import load_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpt_dir(ckpt_dir):
    """The session's random tiny checkpoint (tests/conftest.py writes it once)."""
    return ckpt_dir


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_ckpt_dir):
    return load_checkpoint(tiny_ckpt_dir)


@pytest.fixture(scope="session")
def tiny_model(tiny_ckpt):
    from flashpd.model.model import Model

    return Model.from_checkpoint(tiny_ckpt, torch.float32)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small ops run faster single-threaded on the shared 2-core machine; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def make_prompt():
    """make_prompt(length, seed) -> random token ids of the tiny vocabulary."""

    def make(length: int, seed: int = 0) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, 512, (length,), generator=g).tolist()

    return make


@pytest.fixture(scope="session")
def assert_global_equal():
    """Bitwise equality of two GlobalKV exports."""

    def check(a, b) -> None:
        assert a.num_tokens == b.num_tokens
        assert a.lookback_ids == b.lookback_ids
        assert set(a.entries) == set(b.entries)
        for src in a.entries:
            assert torch.equal(a.entries[src].kv, b.entries[src].kv), f"kv of source {src}"
            assert torch.equal(a.entries[src].keys, b.entries[src].keys), f"keys of source {src}"

    return check
