"""DenseSeqState: strict ordering, W-1 window, global export/import."""

from __future__ import annotations

import pytest
import torch

from flashpd.model.model import SeqPlan
from flashpd.model.presets import preset_config
from flashpd.model.state import DenseSeqState, Entries, GlobalKV, OpenGroup, StateError


@pytest.fixture(scope="module")
def cfg():
    return preset_config("tiny")


def test_window_keeps_the_last_w_minus_1_positions(cfg):
    state = DenseSeqState(cfg)
    kv = torch.arange(200, dtype=torch.float32)[:, None].repeat(1, cfg.head_dim)
    state.append_window(3, 0, kv[:150])
    state.append_window(3, 150, kv[150:])
    win = state.window(3)
    assert (win.start_pos, win.end_pos) == (200 - 127, 200)
    assert torch.equal(win.kv, kv[73:])


def test_appends_must_be_contiguous(cfg):
    state = DenseSeqState(cfg)
    with pytest.raises(StateError, match="window append at 5"):
        state.append_window(0, 5, torch.zeros(1, cfg.head_dim))
    with pytest.raises(StateError, match="appended at 1"):
        state.append_entries(2, 1, torch.zeros(1, cfg.head_dim), torch.zeros(1, 32))
    state.clip_window(0, 5)
    state.append_window(0, 5, torch.zeros(1, cfg.head_dim))
    assert state.window(0).start_pos == 5


def test_open_groups_only_for_ratio2_sources(cfg):
    state = DenseSeqState(cfg)
    row = OpenGroup(torch.ones(cfg.head_dim), torch.zeros(cfg.head_dim))
    state.set_open_group(2, row)
    assert state.open_group(2) is row
    with pytest.raises(StateError, match="not a ratio-2"):
        state.open_group(6)


def test_global_state_round_trip_unsets_windows(tiny_model, make_prompt, assert_global_equal):
    state = tiny_model.new_state()
    tiny_model.run(state, make_prompt(61, seed=50), SeqPlan.encoder_only())
    exported = state.global_state()
    assert exported.num_tokens == 61 and len(exported.lookback_ids) == 3
    assert {s: e.num_entries for s, e in exported.entries.items()} == {2: 30, 4: 30, 6: 61}
    other = tiny_model.new_state()
    other.load_global_state(exported)
    assert_global_equal(other.global_state(), exported)
    with pytest.raises(StateError, match="unset"):
        other.window(0)
    assert other.open_group(2) is None


def test_load_refuses_inconsistent_entry_counts(cfg):
    d, di = cfg.head_dim, cfg.index_head_dim
    entries = {s: Entries(torch.zeros(n, d), torch.zeros(n, di)) for s, n in ((2, 5), (4, 5), (6, 9))}
    with pytest.raises(StateError, match="source 6: 9 entries for 10 tokens"):
        DenseSeqState(cfg).load_global_state(GlobalKV(10, (1, 2, 3), entries))


def test_token_count_never_goes_back(cfg):
    state = DenseSeqState(cfg)
    state.record_tokens(4, (1, 2, 3))
    with pytest.raises(StateError):
        state.record_tokens(3, (1, 2, 3))
    with pytest.raises(StateError, match="lookback"):
        state.record_tokens(5, (1,))
