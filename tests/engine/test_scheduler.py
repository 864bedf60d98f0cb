import pytest

from flashpd.engine.kv_cache_manager import KVCacheManager
from flashpd.engine.policies import DecodeRole, ForwardPath, PrefillRole, role_from_name
from flashpd.engine.request import FinishReason, PrefixPolicy, Replay, Request, RequestStatus
from flashpd.engine.sampling_params import SamplingParams
from flashpd.engine.scheduler import FinishSignal, Scheduler, SchedulerConfig, StepPlan, StepResult

C = 4  # chunk tokens; the replay is one chunk


def make(budget=16, max_seqs=8, num_blocks=16, num_slots=8, role=None) -> Scheduler:
    kv = KVCacheManager(num_blocks, num_slots, C, namespace="tiny|")
    return Scheduler(SchedulerConfig(budget, max_seqs), kv, role)


def req(request_id: str, prompt, max_tokens=4, **params) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, **params))


def step(s: Scheduler, signals=None) -> tuple[StepPlan, dict]:
    """One step with a fake runner that samples 1000 + (position of the sampled token)."""
    plan = s.schedule()
    sampled = {c.request_id: [1000 + c.end] for c in plan.chunks if c.needs_logits}
    outputs = s.update(plan, StepResult(sampled, signals or {}))
    return plan, {o.request_id: o for o in outputs}


def ranges(plan: StepPlan) -> list[tuple[str, int, int]]:
    return [(c.request_id, c.start, c.end) for c in plan.chunks]


def test_chunked_prefill_respects_the_token_budget():
    s = make(budget=4)
    s.add(req("a", range(10), max_tokens=2))
    plans = [step(s)[0] for _ in range(4)]
    assert [ranges(p) for p in plans] == [[("a", 0, 4)], [("a", 4, 8)], [("a", 8, 10)], [("a", 10, 11)]]
    assert [p.chunks[0].block_ids for p in plans] == [(0,), (0, 1), (0, 1, 2), (0, 1, 2)]
    assert [p.chunks[0].needs_logits for p in plans] == [False, False, True, True]
    assert all(p.num_tokens <= 4 for p in plans)
    assert not s.has_unfinished()


def test_decodes_share_each_step_with_a_long_prefill():
    s = make(budget=5)
    s.add(req("a", range(3), max_tokens=8))
    s.add(req("b", range(100, 112), max_tokens=1))
    assert ranges(step(s)[0]) == [("a", 0, 3), ("b", 0, 2)]
    assert ranges(step(s)[0]) == [("a", 3, 4), ("b", 2, 6)]
    assert ranges(step(s)[0]) == [("a", 4, 5), ("b", 6, 10)]
    plan, outputs = step(s)
    assert ranges(plan) == [("a", 5, 6), ("b", 10, 12)]
    assert outputs["b"].finish_reason is FinishReason.LENGTH


def test_decodes_go_before_an_earlier_request_still_prefilling():
    s = make(budget=3, role=DecodeRole())
    s.reserve(req("early", range(12)))
    s.reserve(req("late", range(100, 102)))
    s.kv_arrived("late")
    assert ranges(step(s)[0]) == [("late", 0, 2)]
    s.kv_arrived("early")
    # early replays its last 4 prompt tokens over two steps; late's decode is planned first.
    assert ranges(step(s)[0]) == [("late", 2, 3), ("early", 8, 10)]
    assert ranges(step(s)[0]) == [("late", 3, 4), ("early", 10, 12)]


def test_a_replay_that_fits_a_step_waits_for_one_instead_of_splitting():
    s = make(budget=6, role=DecodeRole())
    for name, base in (("a", 0), ("b", 100)):
        s.reserve(req(name, range(base, base + 12)))
        s.kv_arrived(name)
    # each replays its last 4 prompt tokens: b does not start with the 2 rows a leaves
    assert ranges(step(s)[0]) == [("a", 8, 12)]
    assert ranges(step(s)[0]) == [("a", 12, 13), ("b", 8, 12)]


def test_a_prefill_prompt_that_fits_a_step_waits_for_one_instead_of_splitting():
    s = make(budget=10, role=PrefillRole())
    s.add(req("a", range(6), max_tokens=1))
    s.add(req("b", range(100, 106), max_tokens=1))
    assert ranges(step(s)[0]) == [("a", 0, 6)]  # b does not start with the 4 left
    assert ranges(step(s)[0]) == [("b", 0, 6)]


def test_a_continuation_replays_to_its_prompt_boundary_then_recomputes_one_token_per_step():
    s = make(budget=16, role=DecodeRole())
    r = Request(
        "c", list(range(12)) + [50, 51, 52], SamplingParams(max_tokens=4), prefix=PrefixPolicy(kv_tokens=12)
    )  # 3 outputs streamed elsewhere
    s.reserve(r)
    s.kv_arrived("c")
    assert ranges(step(s)[0]) == [("c", 8, 12)]  # the original replay, alone
    plan, out = step(s)
    assert ranges(plan) == [("c", 12, 13)] and not plan.chunks[0].needs_logits
    assert ranges(step(s)[0]) == [("c", 13, 14)]
    plan, out = step(s)
    assert ranges(plan) == [("c", 14, 15)] and out["c"].new_token_ids == (1015,)


def test_max_num_seqs_caps_the_running_set():
    s = make(max_seqs=2)
    for name in "abc":
        s.add(req(name, range(3), max_tokens=2))
    plan, _ = step(s)
    assert [c.request_id for c in plan.chunks] == ["a", "b"]
    assert s.num_running == 2 and s.num_waiting == 1
    plan, _ = step(s)  # a and b finish on this step
    assert [c.request_id for c in plan.chunks] == ["a", "b"]
    assert [c.request_id for c in step(s)[0].chunks] == ["c"]


def test_head_of_line_blocks_later_requests_that_would_fit():
    s = make(num_blocks=4, budget=32)
    s.add(req("a", range(8), max_tokens=5))  # 2 blocks now, 3 later
    s.add(req("b", range(100, 108), max_tokens=5))
    assert ranges(step(s)[0]) == [("a", 0, 8), ("b", 0, 8)]
    plan, _ = step(s)
    # a grows into a third block: b, the most recent running request, is preempted.
    assert plan.preempted_request_ids == ("b",)
    assert ranges(plan) == [("a", 8, 9)]
    s.add(req("c", [7], max_tokens=1))
    plan, _ = step(s)
    # b needs 3 blocks and cannot get them; c needs 1 and could evict b's cached chunk 0,
    # but does not overtake b.
    assert s.kv.usage()["blocks_cached"] == 1
    assert ranges(plan) == [("a", 9, 10)]
    assert s.status("b") is RequestStatus.PREEMPTED and s.status("c") is RequestStatus.WAITING


def test_prefix_hit_starts_after_whole_chunks_minus_the_replay():
    s = make()
    s.add(req("a", range(10), max_tokens=1))
    step(s)
    s.add(req("b", list(range(10)) + [20, 21], max_tokens=1))
    plan, outputs = step(s)
    (chunk,) = plan.chunks
    assert (chunk.start, chunk.end) == (4, 12)  # hit 8 tokens (2 chunks) - 4 replayed
    assert chunk.block_ids == (0, 1, 3)  # a's chunks 0 and 1 reused; block 2 was a's tail
    assert chunk.replay == Replay(4, 8)
    assert chunk.fresh_slot and chunk.history_token_ids == (1, 2, 3)
    assert chunk.token_ids == (4, 5, 6, 7, 8, 9, 20, 21)
    assert outputs["b"].num_cached_tokens == 4


def test_a_hit_covering_the_whole_prompt_replays_its_last_chunk():
    s = make()
    s.add(req("a", range(8), max_tokens=1))
    step(s)
    s.add(req("b", range(8), max_tokens=1))
    (chunk,) = step(s)[0].chunks
    assert (chunk.start, chunk.end, chunk.needs_logits) == (4, 8, True)
    assert chunk.replay == Replay(4, 8) and chunk.block_ids == (0, 1)


def test_preemption_recomputes_prompt_and_outputs_and_keeps_them():
    s = make(budget=16, num_blocks=4, num_slots=2)
    a = req("a", range(7), max_tokens=6)
    b = req("b", range(100, 107), max_tokens=6)
    s.add(a)
    s.add(b)
    step(s)
    step(s)
    assert b.output_token_ids == [1007, 1008]
    plan, _ = step(s)  # a needs a third block; the pool is full
    assert plan.preempted_request_ids == ("b",) and plan.freed_request_ids == ("b",)
    assert ranges(plan) == [("a", 8, 9)]
    assert plan.chunks[0].block_ids == (0, 1, 3)  # b's tail chunk (block 3) was evicted first
    assert b.status is RequestStatus.PREEMPTED and b.output_token_ids == [1007, 1008]
    for _ in range(3):
        step(s)
    assert a.finish_reason is FinishReason.LENGTH
    plan, _ = step(s)
    (chunk,) = plan.chunks
    # b resumes from its own cached chunk 0 (block 2), recomputing prompt + both outputs.
    assert (chunk.request_id, chunk.start, chunk.end) == ("b", 0, 9)
    assert chunk.token_ids == (100, 101, 102, 103, 104, 105, 106, 1007, 1008)
    assert chunk.block_ids == (2, 3, 1) and chunk.replay == Replay(0, 4)
    while s.has_unfinished():
        step(s)
    assert b.output_token_ids == [1007, 1008, 1009, 1010, 1011, 1012]
    assert b.num_preemptions == 1 and s.num_preemptions == 1


def test_a_request_that_cannot_grow_alone_preempts_itself():
    s = make(num_blocks=4, role=DecodeRole())
    s.reserve(req("a", range(4), max_tokens=3))  # block 0
    s.reserve(req("b", range(100, 112)))  # blocks 1, 2, 3, KV not here yet
    s.kv_arrived("a")
    assert ranges(step(s)[0]) == [("a", 0, 4)]
    plan, _ = step(s)  # a needs a second block; only a is running
    assert plan.chunks == () and plan.preempted_request_ids == ("a",)
    assert s.status("a") is RequestStatus.PREEMPTED
    assert step(s)[0].chunks == ()  # still no room
    s.abort("b")
    (chunk,) = step(s)[0].chunks
    # a recomputes prompt + output locally, from its own cached chunk 0.
    assert (chunk.request_id, chunk.start, chunk.end) == ("a", 0, 5)
    assert chunk.block_ids == (0, 3) and chunk.replay == Replay(0, 4)


def test_arrived_kv_is_admitted_before_a_preempted_request_waiting_for_memory():
    s = make(num_blocks=4, role=DecodeRole())
    s.reserve(req("a", range(4), max_tokens=3))
    s.reserve(req("b", range(100, 112), max_tokens=2))
    s.kv_arrived("a")
    step(s)
    s.kv_arrived("b")
    plan, _ = step(s)
    assert plan.preempted_request_ids == ("a",)  # a preempts itself
    assert plan.chunks == ()  # a step that preempted admits nobody
    plan, _ = step(s)
    assert ranges(plan) == [("b", 8, 12)]  # b overtakes a: it needs no new memory
    assert s.status("a") is RequestStatus.PREEMPTED


def test_the_victim_already_planned_this_step_gives_back_its_tokens():
    s = make(num_blocks=5, num_slots=3, max_seqs=3, budget=3)
    for name, first_token in (("a", 0), ("d", 50), ("b", 100)):
        s.add(req(name, [first_token], max_tokens=9))

    def a_and_d_get_two_tokens() -> StepPlan:
        plan = s.schedule()
        sampled = {c.request_id: [8] if c.request_id == "b" else [7, 7] for c in plan.chunks if c.needs_logits}
        s.update(plan, StepResult(sampled))
        return plan

    assert ranges(a_and_d_get_two_tokens()) == [("a", 0, 1), ("d", 0, 1), ("b", 0, 1)]
    # b computes one token per step, so it is planned first; a and d compute two.
    assert ranges(a_and_d_get_two_tokens()) == [("b", 1, 2), ("a", 1, 3)]
    assert ranges(a_and_d_get_two_tokens()) == [("b", 2, 3), ("a", 3, 5)]
    assert ranges(a_and_d_get_two_tokens()) == [("b", 3, 4), ("a", 5, 7)]
    plan = a_and_d_get_two_tokens()
    # a needs a third block: b (most recent) is preempted although already planned, and its
    # token of budget goes to d.
    assert plan.preempted_request_ids == ("b",)
    assert ranges(plan) == [("a", 7, 9), ("d", 1, 2)]


def test_max_tokens_finishes_with_length():
    s = make()
    s.add(req("a", range(3), max_tokens=2))
    _, out1 = step(s)
    _, out2 = step(s)
    assert out1["a"].new_token_ids == (1003,) and not out1["a"].finished
    assert out2["a"].finish_reason is FinishReason.LENGTH and out2["a"].num_output_tokens == 2
    assert s.status("a") is None and s.kv.usage()["slots_free"] == 8


def test_stop_token_ids_finish_with_stop():
    s = make()
    s.add(req("a", range(3), max_tokens=9, stop_token_ids=(1004,)))
    step(s)
    _, outputs = step(s)
    assert outputs["a"].finish_reason is FinishReason.STOP
    assert outputs["a"].new_token_ids == (1004,)


def test_eos_signal_finishes_unless_ignore_eos():
    s = make()
    s.add(req("a", range(3), max_tokens=9))
    s.add(req("b", range(3), max_tokens=9, ignore_eos=True))
    _, outputs = step(s, {"a": FinishSignal.EOS, "b": FinishSignal.EOS})
    assert outputs["a"].finish_reason is FinishReason.STOP
    assert not outputs["b"].finished


def test_stop_signal_finishes_even_with_ignore_eos():
    s = make()
    s.add(req("a", range(3), max_tokens=9, ignore_eos=True))
    _, outputs = step(s, {"a": FinishSignal.STOP})
    assert outputs["a"].finish_reason is FinishReason.STOP


def test_a_stop_on_the_last_allowed_token_reports_stop():
    s = make()
    s.add(req("a", range(3), max_tokens=1))
    _, outputs = step(s, {"a": FinishSignal.EOS})
    assert outputs["a"].finish_reason is FinishReason.STOP


def test_extra_sampled_tokens_beyond_max_tokens_are_dropped():
    s = make()
    s.add(req("a", range(3), max_tokens=2))
    plan = s.schedule()
    (output,) = s.update(plan, StepResult({"a": [7, 8, 9]}))
    assert output.new_token_ids == (7, 8) and output.finish_reason is FinishReason.LENGTH


def test_abort_while_waiting_running_or_in_flight_frees_everything():
    s = make(max_seqs=1)
    s.add(req("a", range(9), max_tokens=4))
    s.add(req("b", range(9), max_tokens=4))
    assert s.abort("b")  # waiting
    plan = s.schedule()
    assert plan.freed_request_ids == ("b",)
    assert s.abort("a")  # in flight: its result is ignored
    assert s.update(plan, StepResult({"a": [5]})) == []
    assert not s.abort("a")
    assert s.kv.usage()["blocks_used"] == 0 and s.kv.usage()["slots_free"] == 8
    assert s.schedule().freed_request_ids == ("a",)
    assert not s.has_unfinished()


def test_prefill_role_finishes_at_kv_ready_without_sampling():
    s = make(budget=4, role=PrefillRole())
    s.add(Request("p", list(range(10))))  # no max_tokens needed
    plans = [step(s) for _ in range(3)]
    assert all(p.path is ForwardPath.ENCODER for p, _ in plans)
    assert all(not c.needs_logits for p, _ in plans for c in p.chunks)
    assert [ranges(p) for p, _ in plans] == [[("p", 0, 4)], [("p", 4, 8)], [("p", 8, 10)]]
    output = plans[-1][1]["p"]
    assert output.finish_reason is FinishReason.KV_READY and output.new_token_ids == ()
    assert output.kv_block_ids == (0, 1, 2)
    # The blocks stay referenced until the KV push is done; the slot is free already.
    assert s.kv.usage()["blocks_used"] == 3 and s.kv.usage()["slots_free"] == 8
    assert s.status("p") is RequestStatus.FINISHED_KV_READY and not s.has_unfinished()
    s.release_kv("p")
    assert s.kv.usage()["blocks_used"] == 0 and s.kv.usage()["blocks_cached"] == 2


def test_prefill_role_replays_on_its_own_hit():
    s = make(role=PrefillRole())
    s.add(Request("p", list(range(10))))
    step(s)
    s.release_kv("p")
    s.add(Request("q", list(range(10)) + [50, 51, 52]))
    (chunk,) = step(s)[0].chunks
    assert (chunk.start, chunk.end, chunk.replay) == (4, 13, Replay(4, 8))


def test_abort_releases_a_finished_prefill_still_holding_kv():
    s = make(role=PrefillRole())
    s.add(Request("p", list(range(6))))
    step(s)
    assert s.abort("p")
    assert s.kv.usage()["blocks_used"] == 0
    with pytest.raises(KeyError):
        s.release_kv("p")


def test_decode_role_reserves_only_what_its_own_hit_lacks():
    s = make(role=DecodeRole())
    first = s.reserve(req("a", range(10)))
    assert first.block_ids == (0, 1, 2) and first.missing_block_ids == (0, 1, 2)
    assert s.status("a") is RequestStatus.WAITING_FOR_KV
    assert s.schedule().chunks == ()  # nothing runnable before the KV arrives
    s.kv_arrived("a")  # caches a's full prompt chunks 0 and 1
    second = s.reserve(req("b", list(range(8)) + [60, 61, 62, 63, 64]))
    assert second.block_ids == (0, 1, 3, 4)
    assert second.missing_block_ids == (3, 4) and second.first_missing_token == 8


def test_decode_role_first_step_replays_the_last_chunk_then_decodes():
    s = make(role=DecodeRole())
    s.reserve(req("a", range(10), max_tokens=2))
    s.kv_arrived("a")
    plan, outputs = step(s)
    (chunk,) = plan.chunks
    assert plan.path is ForwardPath.FULL
    assert (chunk.start, chunk.end, chunk.needs_logits) == (6, 10, True)
    assert chunk.replay == Replay(6, 10) and chunk.fresh_slot
    assert chunk.history_token_ids == (3, 4, 5)
    assert outputs["a"].new_token_ids == (1010,)
    plan, outputs = step(s)
    assert ranges(plan) == [("a", 10, 11)] and plan.chunks[0].replay is None
    assert outputs["a"].finish_reason is FinishReason.LENGTH


def test_decode_role_short_prompt_replays_all_of_it():
    s = make(role=DecodeRole())
    s.reserve(req("a", range(3), max_tokens=1))
    s.kv_arrived("a")
    (chunk,) = step(s)[0].chunks
    assert (chunk.start, chunk.end, chunk.replay) == (0, 3, Replay(0, 3))


def test_decode_role_reserve_returns_none_when_short_and_registers_nothing():
    s = make(role=DecodeRole(), num_blocks=4)
    assert s.reserve(req("a", range(12))) is not None
    assert s.reserve(req("b", range(100, 108))) is None
    assert s.status("b") is None and s.kv.usage()["blocks_free"] == 1
    with pytest.raises(ValueError):
        s.add(req("c", range(3)))
    with pytest.raises(KeyError):
        s.kv_arrived("b")


def test_abort_while_waiting_for_kv_frees_the_reservation():
    s = make(role=DecodeRole())
    s.reserve(req("a", range(10)))
    assert s.abort("a")
    assert s.kv.usage()["blocks_used"] == 0 and s.kv.usage()["slots_free"] == 8


def test_add_rejects_requests_that_can_never_fit_or_lack_max_tokens():
    s = make(num_blocks=4)
    s.add(req("fits", range(12), max_tokens=5))  # 16 tokens with KV at most
    with pytest.raises(ValueError, match="blocks"):
        s.add(req("big", range(12), max_tokens=6))
    with pytest.raises(ValueError, match="max_tokens"):
        s.add(Request("x", [1, 2]))
    with pytest.raises(ValueError, match="already"):
        s.add(req("fits", range(3)))
    with pytest.raises(ValueError):
        req("bad", range(3), max_tokens=0)


def test_update_is_strict_about_results():
    s = make()
    s.add(req("a", range(3)))
    plan = s.schedule()
    with pytest.raises(RuntimeError):
        s.schedule()  # the previous plan was not applied
    with pytest.raises(ValueError):
        s.update(plan, StepResult({"a": [1], "ghost": [2]}))
    with pytest.raises(ValueError, match="no token"):
        s.update(plan, StepResult({}))
    s.update(plan, StepResult({"a": [1]}))  # rejected results changed nothing
    s.add(req("b", range(3)))
    plan = s.schedule()
    assert ranges(plan) == [("a", 3, 4), ("b", 0, 3)]
    s.update(plan, StepResult({"a": [1], "b": [2]}))
    with pytest.raises(RuntimeError):
        s.update(plan, StepResult({"a": [1], "b": [2]}))


def test_empty_plans_need_no_update():
    s = make()
    assert s.schedule().chunks == ()
    assert s.schedule().chunks == ()


def test_roles_by_name_are_strict():
    assert role_from_name("prefill").path is ForwardPath.ENCODER
    with pytest.raises(ValueError):
        role_from_name("both")


# ---- schedule_ahead (async scheduling) --------------------------------------------------------


def _decoding(s: Scheduler, *rids: str, max_tokens=8) -> StepPlan:
    """Requests admitted and prefilled; the returned plan is their first decode step (not
    updated)."""
    for rid in rids:
        s.add(req(rid, range(10, 16), max_tokens=max_tokens))
    step(s)  # prefill
    return s.schedule()


def test_ahead_plans_the_next_decode_with_a_pending_token():
    from flashpd.engine.scheduler import PENDING_TOKEN

    s = make()
    plan = _decoding(s, "a", "b")
    ahead = s.schedule_ahead(plan)
    assert ahead is not None and ranges(ahead) == [("a", 7, 8), ("b", 7, 8)]
    chunk = ahead.chunks[0]
    assert chunk.token_ids == (PENDING_TOKEN,) and chunk.needs_logits
    assert chunk.history_token_ids == (14, 15, 1006)  # known ids before the pending one
    with pytest.raises(RuntimeError):
        s.schedule()  # two steps outstanding
    with pytest.raises(RuntimeError):
        s.update(ahead, StepResult({"a": [1], "b": [2]}))  # out of order
    s.update(plan, StepResult({"a": [1008], "b": [1008]}))
    outputs = {o.request_id: o for o in s.update(ahead, StepResult({"a": [9], "b": [9]}))}
    assert outputs["a"].new_token_ids == (9,) and s.schedule_ahead(ahead) is None


def test_ahead_leaves_out_the_last_token_admits_arrivals_and_stops_for_aborts():
    s = make()
    plan = _decoding(s, "a", "b", max_tokens=2)  # the plan's token is their 2nd and last
    assert s.schedule_ahead(plan) is None
    s.update(plan, StepResult({"a": [1], "b": [2]}))
    plan = _decoding(s, "c", "d")
    s.add(req("late", range(5)))
    ahead = s.schedule_ahead(plan)  # the arrival is admitted with the pending decodes
    assert ranges(ahead) == [("c", 7, 8), ("d", 7, 8), ("late", 0, 5)]
    s.update(plan, StepResult({"c": [1], "d": [2]}))
    s.update(ahead, StepResult({"c": [3], "d": [4], "late": [5]}))
    plan = s.schedule()
    ahead = s.schedule_ahead(plan)  # late's prompt ended with a sample: it decodes ahead too
    assert ranges(ahead) == [("c", 9, 10), ("d", 9, 10), ("late", 6, 7)]
    s.update(plan, StepResult({"c": [1], "d": [2], "late": [3]}))
    s.update(ahead, StepResult({"c": [1], "d": [2], "late": [3]}))
    plan = s.schedule()
    s.abort("d")
    assert s.schedule_ahead(plan) is None  # a request of the plan is gone


def test_ahead_stops_for_a_prompt_chunk_that_does_not_sample():
    s = make(budget=4)
    s.add(req("long", range(10, 20)))
    plan = s.schedule()  # tokens 0-3 of 10
    assert not plan.chunks[0].needs_logits and s.schedule_ahead(plan) is None


def test_ahead_drops_the_row_of_a_request_that_stopped_on_the_token_before():
    s = make()
    plan = _decoding(s, "a", "b")
    ahead = s.schedule_ahead(plan)
    s.update(plan, StepResult({"a": [1], "b": [2]}, {"a": FinishSignal.STOP}))
    outputs = s.update(ahead, StepResult({"a": [3], "b": [4]}))
    assert [o.request_id for o in outputs] == ["b"]
    assert s.status("a") is None and s.kv.usage()["blocks_used"] <= 2
