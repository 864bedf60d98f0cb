"""Fixtures shared by the GPU-path tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def cheap_forward(monkeypatch):
    """`cheap_forward(gpu)` replaces the layers by zeros (a fake at the compute seam: the
    interpreter would take an hour over a warm-up): the tables are prepared, expanded and
    committed as the forward's, the logits are zeros and the open rows' records zero bytes.
    For tests of which graphs are built and taken, a function of the steps' shapes alone."""

    def apply(gpu) -> None:
        def compute(step):
            step.tables.materialise()
            pools = step.tables.pools
            step.outputs = {}
            for src in pools.open_row_of:
                step.outputs[("open", src)] = torch.zeros(
                    step.token_ids.shape[0], *pools.open.shape[2:], dtype=pools.open.dtype, device=pools.open.device
                )
            n = step.logit_rows.numel()
            return None if n == 0 else torch.zeros(n, gpu.cfg.vocab_size, device=step.token_ids.device)

        monkeypatch.setattr(gpu, "compute", compute)

    return apply
