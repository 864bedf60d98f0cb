"""Incremental prompt building: same ids as building from scratch, outputs spliced in place."""

from __future__ import annotations

import numpy as np
import pytest

from flashpd.bench.prompts import PromptBuilder


@pytest.mark.parametrize("which", ["small_workload", "compacting_workload"])
def test_incremental_prompts_equal_prompts_built_from_scratch(which, request):
    workload = request.getfixturevalue(which)
    assert any(r.is_subagent for r in workload.requests())
    builder = PromptBuilder(workload.token_space, splice_outputs=False)
    for tree in workload.trees:
        builder.clear()
        for req in tree.requests:
            assert builder.build(req).tolist() == workload.prompt_ids(req)


def test_server_output_replaces_the_synthetic_output_region(small_workload):
    builder = PromptBuilder(small_workload.token_space, splice_outputs=True)
    main = [r for r in small_workload.trees[0].requests if not r.is_subagent]
    first, second = main[0], main[1]
    first_ids = builder.build(first)
    output = list(range(1, first.max_tokens + 1))
    builder.record_output(first, output)
    second_ids = builder.build(second)
    n = len(first_ids)
    assert np.array_equal(second_ids[:n], first_ids)
    assert second_ids[n : n + len(output)].tolist() == output
    assert second_ids[n + len(output) :].tolist() == small_workload.prompt_ids(second)[n + len(output) :]


def test_spliced_outputs_persist_in_later_prompts_of_the_session(small_workload):
    builder = PromptBuilder(small_workload.token_space, splice_outputs=True)
    main = [r for r in small_workload.trees[0].requests if not r.is_subagent][:3]
    ids = builder.build(main[0])
    builder.record_output(main[0], [7] * main[0].max_tokens)
    builder.build(main[1])
    third = builder.build(main[2])
    assert third[len(ids) : len(ids) + main[0].max_tokens].tolist() == [7] * main[0].max_tokens


def test_without_splicing_outputs_are_ignored(small_workload):
    builder = PromptBuilder(small_workload.token_space, splice_outputs=False)
    first, second = [r for r in small_workload.trees[0].requests if not r.is_subagent][:2]
    builder.build(first)
    builder.record_output(first, [7] * first.max_tokens)
    assert builder.build(second).tolist() == small_workload.prompt_ids(second)
