"""Property-based storms: random add / step / abort / finish sequences on tiny pools.

After every operation: no block or slot leaks (free + referenced + cached == total, refcounts
equal the block tables that hold them, every running request owns a slot), and streamed outputs
add up to each request's outputs. At the end everything finishes, and after that every block is
free or cached-evictable and every slot is free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashpd.engine.kv_cache_manager import KVCacheManager
from flashpd.engine.policies import ColocatedRole, DecodeRole, PrefillRole
from flashpd.engine.request import Request, RequestStatus
from flashpd.engine.sampling_params import SamplingParams
from flashpd.engine.scheduler import FinishSignal, Scheduler, SchedulerConfig, StepResult

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 20, 21, 22, 23, 24, 25, 26, 27]]
STORM = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


def operations(prompt_tokens: int, max_tokens: tuple[int, int], step_weight: int):
    add = st.tuples(st.just("add"), st.integers(0, 1), st.integers(1, prompt_tokens), st.integers(*max_tokens))
    others = [
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("arrive"), st.integers(0, 30)),
        st.tuples(st.just("release"), st.integers(0, 30)),
        st.tuples(st.just("reset")),
    ]
    return st.one_of(add, *[st.tuples(st.just("step"))] * step_weight, *others)


@dataclass(frozen=True)
class Sizes:
    chunk_tokens: tuple[int, int] = (2, 4)
    num_blocks: tuple[int, int] = (4, 9)
    num_slots: tuple[int, int] = (1, 5)
    budget: tuple[int, int] = (1, 12)
    max_num_seqs: tuple[int, int] = (1, 5)


ANY_SIZES = Sizes()
ANY_OPS = operations(prompt_tokens=12, max_tokens=(1, 12), step_weight=3)
# Several requests growing at once in a pool that cannot hold them all: preemption storms.
PRESSURE_SIZES = Sizes(chunk_tokens=(2, 2), num_blocks=(5, 7), num_slots=(3, 4), max_num_seqs=(3, 4))
PRESSURE_OPS = operations(prompt_tokens=6, max_tokens=(4, 8), step_weight=6)


@dataclass
class Storm:
    scheduler: Scheduler
    requests: dict[str, Request] = field(default_factory=dict)
    streamed: dict[str, list[int]] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)

    @property
    def kv(self) -> KVCacheManager:
        return self.scheduler.kv

    def pick(self, index: int) -> str | None:
        ids = sorted(self.requests)
        return ids[index % len(ids)] if ids else None


def make_storm(data, role, sizes: Sizes = ANY_SIZES) -> Storm:
    chunk_tokens = data.draw(st.integers(*sizes.chunk_tokens), label="chunk_tokens")
    kv = KVCacheManager(
        num_blocks=data.draw(st.integers(*sizes.num_blocks), label="num_blocks"),
        num_slots=data.draw(st.integers(*sizes.num_slots), label="num_slots"),
        chunk_tokens=chunk_tokens,
        namespace="storm|",
        replay_tokens=data.draw(st.integers(1, chunk_tokens), label="replay_tokens"),
    )
    config = SchedulerConfig(
        max_num_batched_tokens=data.draw(st.integers(*sizes.budget), label="budget"),
        max_num_seqs=data.draw(st.integers(*sizes.max_num_seqs), label="max_num_seqs"),
    )
    return Storm(Scheduler(config, kv, role))


def do_add(storm: Storm, prefix: int, length: int, max_tokens: int, serial: int) -> None:
    prompt = (PREFIXES[prefix] + [100 + serial] * 14)[:length]
    request = Request(f"r{serial}", prompt, SamplingParams(max_tokens=max_tokens))
    scheduler = storm.scheduler
    try:
        if isinstance(scheduler.role, DecodeRole):
            if scheduler.reserve(request) is None:
                return
        else:
            scheduler.add(request)
    except ValueError as error:
        assert "blocks" in str(error)  # the only refusal: it could never fit in the pool
        return
    storm.requests[request.request_id] = request
    storm.streamed[request.request_id] = []


def do_step(storm: Storm, data) -> None:
    plan = storm.scheduler.schedule()
    assert plan.num_tokens <= storm.scheduler.config.max_num_batched_tokens
    assert len(plan.chunks) <= storm.scheduler.config.max_num_seqs
    sampled, signals = {}, {}
    for chunk in plan.chunks:
        assert chunk.block_ids == tuple(storm.kv.block_table(chunk.request_id))
        assert len(chunk.block_ids) * storm.kv.chunk_tokens >= chunk.end
        if chunk.needs_logits:
            sampled[chunk.request_id] = data.draw(st.lists(st.integers(0, 50), min_size=1, max_size=2))
            signal = data.draw(st.sampled_from([None, None, None, FinishSignal.EOS, FinishSignal.STOP]))
            if signal is not None:
                signals[chunk.request_id] = signal
    for output in storm.scheduler.update(plan, StepResult(sampled, signals)):
        storm.streamed[output.request_id].extend(output.new_token_ids)
        if output.finished:
            storm.finished.add(output.request_id)


def apply(storm: Storm, operation, data, serial: int) -> None:
    name, *args = operation
    scheduler = storm.scheduler
    if name == "add":
        do_add(storm, *args, serial)
    elif name == "step":
        do_step(storm, data)
    elif name == "abort" and (request_id := storm.pick(args[0])) is not None:
        was_live = scheduler.status(request_id) is not None
        assert scheduler.abort(request_id) is was_live
    elif name == "arrive" and (request_id := storm.pick(args[0])) is not None:
        if scheduler.status(request_id) is RequestStatus.WAITING_FOR_KV:
            scheduler.kv_arrived(request_id)
    elif name == "release" and (request_id := storm.pick(args[0])) is not None:
        if scheduler.status(request_id) is RequestStatus.FINISHED_KV_READY:
            scheduler.release_kv(request_id)
    elif name == "reset":
        storm.kv.reset()


def check_invariants(storm: Storm) -> None:
    kv, scheduler = storm.kv, storm.scheduler
    kv.check_consistency()
    usage = kv.usage()
    assert usage["blocks_free"] + usage["blocks_used"] + usage["blocks_cached"] == usage["blocks_total"]
    held = [rid for rid in storm.requests if kv.holds(rid)]
    referenced = {block for rid in held for block in kv.block_table(rid)}
    assert len(referenced) == usage["blocks_used"]
    assert usage["requests"] == len(held)
    for request_id, request in storm.requests.items():
        status = scheduler.status(request_id)
        if status is RequestStatus.RUNNING:
            assert kv.holds(request_id) and kv.slot(request_id) >= 0
        if status is None:
            assert not kv.holds(request_id)
        assert storm.streamed[request_id] == request.output_token_ids
        if request.max_tokens is not None:
            assert request.num_output_tokens <= request.max_tokens
    assert usage["slots_used"] == len([r for r in held if _has_slot(kv, r)])


def _has_slot(kv: KVCacheManager, request_id: str) -> bool:
    try:
        kv.slot(request_id)
    except ValueError:
        return False
    return True


def drain(storm: Storm, data) -> None:
    """Deliver all KV, run everything to completion, releasing held KV as its push completes."""
    scheduler = storm.scheduler
    for request_id in list(storm.requests):
        if scheduler.status(request_id) is RequestStatus.WAITING_FOR_KV:
            scheduler.kv_arrived(request_id)
    for _ in range(400):
        release_sent_kv(storm)
        if not scheduler.has_unfinished():
            break
        do_step(storm, data)
        check_invariants(storm)
    assert not scheduler.has_unfinished(), "requests starved"


def release_sent_kv(storm: Storm) -> None:
    for request_id in storm.requests:
        if storm.scheduler.status(request_id) is RequestStatus.FINISHED_KV_READY:
            storm.scheduler.release_kv(request_id)


def run_storm(data, role, sizes: Sizes = ANY_SIZES, ops=ANY_OPS) -> None:
    storm = make_storm(data, role, sizes)
    script = data.draw(st.lists(ops, min_size=10, max_size=60), label="operations")
    for serial, operation in enumerate(script):
        apply(storm, operation, data, serial)
        check_invariants(storm)
    drain(storm, data)
    usage = storm.kv.usage()
    assert usage["blocks_used"] == 0 and usage["requests"] == 0
    assert usage["blocks_free"] + usage["blocks_cached"] == usage["blocks_total"]
    assert usage["slots_free"] == usage["slots_total"]
    for request_id in storm.requests:
        assert storm.scheduler.status(request_id) is None
    finished_or_aborted = storm.finished | {
        rid for rid, r in storm.requests.items() if r.status is RequestStatus.FINISHED_ABORTED
    }
    assert finished_or_aborted == set(storm.requests)


@STORM
@given(st.data())
def test_colocated_storm_leaks_nothing(data):
    run_storm(data, ColocatedRole())


@STORM
@given(st.data())
def test_prefill_storm_leaks_nothing(data):
    run_storm(data, PrefillRole())


@STORM
@given(st.data())
def test_decode_storm_leaks_nothing(data):
    run_storm(data, DecodeRole())


@STORM
@given(st.data())
def test_preemption_storm_leaks_nothing_and_finishes_everyone(data):
    run_storm(data, ColocatedRole(), PRESSURE_SIZES, PRESSURE_OPS)


@STORM
@given(st.data())
def test_decode_preemption_storm_leaks_nothing(data):
    run_storm(data, DecodeRole(), PRESSURE_SIZES, PRESSURE_OPS)


@STORM
@given(st.data())
def test_abort_everything_leaves_only_free_or_cached_blocks(data):
    storm = make_storm(data, ColocatedRole())
    for serial, operation in enumerate(data.draw(st.lists(ANY_OPS, min_size=10, max_size=40))):
        apply(storm, operation, data, serial)
    for request_id in list(storm.requests):
        storm.scheduler.abort(request_id)
    check_invariants(storm)
    usage = storm.kv.usage()
    assert usage["blocks_used"] == 0 and usage["slots_free"] == usage["slots_total"]
    assert not storm.scheduler.has_unfinished()
