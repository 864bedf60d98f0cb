"""`flashpd train --drafter` pieces on the tiny preset (CPU): loss, gradients, export, AL walk."""

from __future__ import annotations

import pytest
import torch

from flashpd.model.checkpoint import load_checkpoint, write_random_checkpoint
from flashpd.model.dspark import DraftOut, DSparkDrafter
from flashpd.model.presets import preset_config
from flashpd.model.train_drafter import (
    TrainDrafter,
    block_batch,
    drafter_loss,
    export_drafter,
    load_frozen_backbone,
    speculative_walk,
    teacher_rows,
)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_base")
    write_random_checkpoint(preset_config("tiny"), str(out), seed=13)
    return str(out)


@pytest.fixture(scope="module")
def backbone(base):
    return load_frozen_backbone(base, "tiny")


@pytest.fixture(scope="module")
def rows(backbone):
    target, _ = backbone
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 500, (4, 48), generator=g)
    ids[3, 30:] = 2  # a padded row: its tail is dropped
    return teacher_rows(target, ids, pad=2, log=lambda *a, **k: None)


def test_teacher_rows_hold_taps_and_greedy_tokens(rows, backbone):
    target, cfg = backbone
    assert [r.ids.numel() for r in rows] == [48, 48, 48, 30]
    assert rows[0].taps.shape == (48, 3 * cfg.hidden_size)
    assert rows[0].greedy.shape == (48,)


def test_training_lowers_the_loss_and_reaches_the_context_path(backbone, rows):
    target, cfg = backbone
    model = TrainDrafter(cfg, target, seed=1)
    batch = block_batch(rows, 4, model.drafter.k, torch.Generator().manual_seed(1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = None
    for step in range(12):
        opt.zero_grad()
        loss, parts = drafter_loss(model, batch)
        loss.backward()
        if step == 0:
            first = parts["ce"]
            for name in (
                "mtp.0.main_proj.weight",
                "mtp.1.attn.wkv.weight",
                "mtp.2.markov_head.head.weight",
                "mtp.0.ffn.experts.0.w1.weight",
            ):
                grad = model.raw(name).grad
                assert grad is not None and grad.abs().sum() > 0, name
        opt.step()
    assert parts["ce"] < first - 0.5


def test_export_serves_the_trained_forward(backbone, rows, base, tmp_path):
    target, cfg = backbone
    model = TrainDrafter(cfg, target, seed=2)
    out = tmp_path / "with_drafter"
    export_drafter(model, base, str(out), max_shard_bytes=1 << 20)
    ckpt = load_checkpoint(str(out))
    assert ckpt.cfg.dspark == cfg.dspark
    served = DSparkDrafter.from_checkpoint(ckpt, target)
    trained = model.refresh()
    ctx = torch.randn(cfg.dspark.num_layers, 2, 128, cfg.head_dim)
    valid = torch.rand(2, 128) > 0.5
    with torch.no_grad():
        a = served.block_pass(ctx, valid, torch.tensor([3, 4]), torch.tensor([130, 200]))
        b = trained.block_pass(ctx, valid, torch.tensor([3, 4]), torch.tensor([130, 200]))
    assert torch.allclose(a[1], b[1], atol=1e-5)  # the export holds what was trained


class _Oracle:
    """A drafter seam for the walk: drafts `hits` correct tokens of the chain, then wrong ones."""

    def __init__(self, chain, prompt_len, hits, k=5):
        self.chain, self.prompt_len, self.hits, self.k = chain, prompt_len, hits, k
        self.inserted = []

    def new_state(self):
        return object()

    def insert_context(self, states, positions, taps):
        assert taps.shape[0] == len(positions[0])
        self.inserted += list(positions[0])

    def draft(self, states, anchors, positions, choose):
        i = positions[0] - self.prompt_len
        assert int(anchors[0]) == self.chain[i]
        good = self.chain[i + 1 : i + 1 + self.hits]
        tokens = good + [-1] * (self.k - len(good))
        return DraftOut(torch.tensor([tokens]), torch.zeros(1, self.k, 1), torch.zeros(1, self.k))


@pytest.mark.parametrize("hits,al", [(0, 1.0), (2, 3.0), (5, 6.0)])
def test_speculative_walk_counts_accepted_plus_bonus(hits, al):
    chain = list(range(100, 160))  # 60 greedy tokens after a 10-token prompt
    oracle = _Oracle(chain, 10, hits)
    steps, emitted = speculative_walk(oracle, 10, chain, torch.zeros(70, 1))
    assert emitted / steps == al
    assert oracle.inserted == list(range(10 + emitted))  # committed positions, each once


def test_confidence_head_trains_at_a_smaller_rate(backbone):
    from flashpd.model.train_drafter import CONFIDENCE_LR_SCALE, _optimizer

    target, cfg = backbone
    model = TrainDrafter(cfg, target)
    groups = _optimizer(model, 1e-3).param_groups
    conf = model.raw("mtp.2.confidence_head.proj.weight")
    assert [g["lr_scale"] for g in groups] == [1.0, CONFIDENCE_LR_SCALE]
    assert any(p is conf for p in groups[1]["params"])
    assert not any(p is conf for p in groups[0]["params"])


def test_speculative_walk_accepting_up_to_the_chains_end_needs_no_tap_past_it():
    # greedy_continuation's taps: one row per computed position, none for the chain's last token
    chain = list(range(100, 166))  # 66 greedy tokens after a 10-token prompt: 75 tap rows
    oracle = _Oracle(chain, 10, 5)
    steps, emitted = speculative_walk(oracle, 10, chain, torch.zeros(75, 1))
    assert (steps, emitted) == (11, 66)  # the last step accepts chain[61..65]: the chain's end
    assert oracle.inserted == list(range(75))  # every position with a tap row, each once
