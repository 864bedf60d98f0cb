"""Session-tree structure, token content and replay files of the generator (small scales)."""

from __future__ import annotations

import numpy as np
import pytest

from flashpd.bench.tokens import Segment, TokenSpace, shared_prefix_tokens
from flashpd.bench.workload import Workload, WorkloadConfig, generate_tree, generate_workload


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0]
    return int(diff[0]) if diff.size else n


def test_same_seed_gives_identical_workloads(workload_config):
    assert generate_workload(workload_config()) == generate_workload(workload_config())


def test_different_seeds_give_different_workloads(workload_config):
    assert generate_workload(workload_config(seed=1)) != generate_workload(workload_config(seed=2))


def test_tree_does_not_depend_on_how_many_trees_are_generated(workload_config):
    few = generate_workload(workload_config(num_trees=2))
    many = generate_workload(workload_config(num_trees=5))
    assert few.trees == many.trees[:2]


def test_jsonl_round_trip_replays_exactly(tmp_path, small_workload):
    path = tmp_path / "wl.jsonl"
    small_workload.write_jsonl(path)
    again = Workload.read_jsonl(path)
    assert again == small_workload
    request = small_workload.trees[1].requests[-1]
    assert again.prompt_ids(again.trees[1].requests[-1]) == small_workload.prompt_ids(request)


def test_read_jsonl_rejects_foreign_files(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"format": "something-else"}\n')
    with pytest.raises(ValueError, match="not a"):
        Workload.read_jsonl(path)


def test_compaction_restarts_the_context_after_the_prefix(compacting_workload):
    compacted = [
        r
        for r in compacting_workload.requests()
        if r.turn_index > 0 and r.ideal_cached_tokens == sum(s.num_tokens for s in r.segments[:2])
    ]
    assert compacted
    assert all(r.prompt_tokens < 80_000 / 200 + 1 + 96_000 / 200 for r in compacting_workload.requests())


@pytest.mark.parametrize("which", ["small_workload", "compacting_workload"])
def test_ideal_cached_is_the_exact_shared_prefix_of_ids(which, request):
    # previous prompt + its output is the ideal prefix; after a compaction (or for a sub-agent's
    # first request, against its parent) exactly salt + system prefix is shared
    workload = request.getfixturevalue(which)
    for tree in workload.trees:
        parent_ids = workload.prompt_ids(tree.requests[0])
        previous: dict[str, tuple[list[int], int]] = {}  # session -> (prompt ids, output tokens)
        for req in tree.requests:
            ids = workload.prompt_ids(req)
            prefix_tokens = sum(s.num_tokens for s in req.segments[:2])
            if req.session_id in previous:
                prev_ids, prev_output = previous[req.session_id]
                if req.ideal_cached_tokens == len(prev_ids) + prev_output:
                    assert ids[: len(prev_ids)] == prev_ids
                else:
                    assert req.ideal_cached_tokens == prefix_tokens
                    assert common_prefix(ids, prev_ids) == prefix_tokens
            elif req.is_subagent:
                assert req.ideal_cached_tokens == prefix_tokens
                assert common_prefix(ids, parent_ids) == prefix_tokens
            previous[req.session_id] = (ids, req.max_tokens)


def test_next_prompt_extends_previous_prompt_plus_output(small_workload):
    tree = small_workload.trees[0]
    main = [r for r in tree.requests if not r.is_subagent]
    for prev, cur in zip(main, main[1:], strict=False):
        if cur.ideal_cached_tokens == prev.prompt_tokens + prev.max_tokens:
            prefix = small_workload.prompt_ids(prev)
            assert small_workload.prompt_ids(cur)[: len(prefix)] == prefix
            assert cur.prompt_tokens == prev.prompt_tokens + prev.max_tokens + cur.new_input_tokens


def test_subagents_share_only_salt_and_system_prefix_with_parent(workload_config):
    workload = generate_workload(workload_config(num_trees=12))
    trees = [t for t in workload.trees if any(r.is_subagent for r in t.requests)]
    assert trees, "no tree with sub-agents in 12 trees"
    tree = trees[0]
    main = tree.requests[0]
    sub = next(r for r in tree.requests if r.is_subagent)
    prefix_tokens = sum(s.num_tokens for s in main.segments[:2])
    assert sub.parent_session_id == main.session_id
    assert sub.ideal_cached_tokens == prefix_tokens
    assert shared_prefix_tokens(sub.segments, main.segments) == prefix_tokens


def test_trees_share_no_prefix_because_of_salts(small_workload):
    a, b = small_workload.trees[0].requests[0], small_workload.trees[1].requests[0]
    assert shared_prefix_tokens(a.segments, b.segments) == 0
    assert small_workload.prompt_ids(a)[0] != small_workload.prompt_ids(b)[0]


def test_instantiate_changes_salt_and_session_ids_only(small_workload):
    tree = small_workload.trees[0]
    copy = tree.instantiate(salt_key=12345, session_prefix="lane0")
    first, moved = tree.requests[0], copy.requests[0]
    assert moved.session_id == "lane0"
    assert moved.segments[1:] == first.segments[1:]
    assert moved.segments[0] == Segment(12345, first.segments[0].num_tokens)
    assert shared_prefix_tokens(moved.segments, first.segments) == 0
    subs = [r for r in copy.requests if r.is_subagent]
    assert all(r.parent_session_id == "lane0" and r.session_id.startswith("lane0/") for r in subs)


def test_scale_divides_token_counts_and_time_scale_divides_think(workload_config):
    full = generate_tree(WorkloadConfig(seed=5, max_turns=20), 0)
    small = generate_tree(WorkloadConfig(seed=5, max_turns=20, scale=100.0, time_scale=10.0), 0)
    assert len(full.requests) == len(small.requests)
    for big, little in zip(full.requests, small.requests, strict=True):
        assert little.max_tokens == max(1, round(big.max_tokens / 100))
        assert little.think_s == pytest.approx(big.think_s / 10)


def test_context_never_passes_the_hard_cap(workload_config):
    config = WorkloadConfig(seed=1, num_trees=40, scale=100.0)
    cap = config.tokens(config.shape.context_cap_tokens)
    for request in generate_workload(config).requests():
        assert request.prompt_tokens + request.max_tokens <= cap


def test_max_turns_caps_main_turns(workload_config):
    workload = generate_workload(workload_config(max_turns=5, num_trees=10))
    for tree in workload.trees:
        assert sum(not r.is_subagent for r in tree.requests) <= 5


def test_first_request_of_a_tree_has_no_think_time_and_no_cache(small_workload):
    for tree in small_workload.trees:
        assert tree.requests[0].think_s == 0.0
        assert tree.requests[0].ideal_cached_tokens == 0


def test_token_ids_stay_in_the_vocab_range():
    space = TokenSpace(vocab_lo=500, vocab_hi=600)
    ids = space.prompt_array([Segment(1, 3000), Segment(2, 10)])
    assert ids.min() >= 500 and ids.max() < 600
    assert len(np.unique(ids)) == 100


def test_block_ids_are_chained_per_64_tokens():
    space = TokenSpace()
    short = space.block_ids([Segment(1, 64), Segment(2, 100)])
    longer = space.block_ids([Segment(1, 64), Segment(2, 200)])
    other = space.block_ids([Segment(9, 64), Segment(2, 200)])
    assert len(short) == 3 and len(longer) == 5
    assert short[:2] == longer[:2]  # same full blocks, same ids
    assert short[2] != longer[2]  # the partial block differs
    assert not set(other) & set(longer)  # a different first block changes every id after it


def test_bad_config_values_raise():
    with pytest.raises(ValueError):
        WorkloadConfig(scale=0.5)
    with pytest.raises(ValueError):
        WorkloadConfig(vocab_lo=10, vocab_hi=10)
    with pytest.raises(ValueError):
        WorkloadConfig(num_trees=0)


def test_too_coarse_scale_raises():
    with pytest.raises(ValueError, match="too coarse"):
        generate_workload(WorkloadConfig(num_trees=20, scale=500_000.0))
