"""Fixtures shared across the tree: one random tiny checkpoint per session and its FP32 model."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

# Folders whose every test is `slow`: they start the whole stack (Ray Serve + Redis + NIXL),
# inject faults into it, or run the GPU path's kernels through Triton's CPU interpreter (minutes).
# The README's test command runs them; plain `pytest` (the quick loop) skips them.
SLOW_FOLDERS = ("services/e2e", "faults", "engine/gpu")
_TESTS_ROOT = Path(__file__).parent
_BENCHMARKS = _TESTS_ROOT.parent / "benchmarks"  # unpackaged kernel microbenchmarks (scripts)


def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(_TESTS_ROOT.resolve()).as_posix()
        if rel.startswith(tuple(f + "/" for f in SLOW_FOLDERS)):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="session")
def _single_torch_thread():
    """The tiny model's small ops run far faster on one thread on the shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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


@pytest.fixture
def benchmark_script(monkeypatch):
    """Loads a script of the unpackaged `benchmarks/` folder by module name, with that folder on
    sys.path as when it runs as `python benchmarks/NAME.py` (its sibling imports resolve)."""
    monkeypatch.syspath_prepend(str(_BENCHMARKS))
    return importlib.import_module
