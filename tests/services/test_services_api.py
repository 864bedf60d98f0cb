import pickle

import pytest

from flashpd.services import api
from flashpd.services.api import (
    ERRORS_BY_CODE,
    InternalRequest,
    InvalidArgument,
    SamplingError,
    SamplingParams,
    TransferFailed,
    Unavailable,
    WorkerRef,
    WorkerStats,
    as_service_error,
)


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_k", -1),
        ("min_p", 1.5),
        ("seed", -1),
        ("logprobs", 21),
        ("stop", ("",)),
        ("stop_token_ids", (-1,)),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", float("nan")),
        ("min_p", float("nan")),
        ("seed", 2**63),
        ("seed", 2**64),
        ("temperature", "1"),
        ("top_p", True),
    ],
)
def test_sampling_errors_name_the_field(field, value):
    with pytest.raises(SamplingError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field
    mapped = as_service_error(info.value)
    assert isinstance(mapped, InvalidArgument) and mapped.field == field
    assert str(mapped).startswith(f"{field}: ")


def test_wire_sampling_is_the_engine_class_and_round_trips():
    from flashpd.engine.sampling import SamplingParams as EngineSampling

    assert SamplingParams is EngineSampling
    p = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, seed=11, stop=("x",), stop_token_ids=(2,), logprobs=2)
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert pickle.loads(pickle.dumps(p)) == p


def test_errors_map_one_to_one_to_codes_and_statuses():
    codes = {cls.code for cls in ERRORS_BY_CODE.values()}
    statuses = {cls.http_status for cls in ERRORS_BY_CODE.values()}
    assert len(codes) == len(statuses) == len(ERRORS_BY_CODE)
    assert TransferFailed.code == Unavailable.code


def test_errors_survive_pickling_with_their_field():
    err = pickle.loads(pickle.dumps(InvalidArgument("must be >= 1", field="max_tokens")))
    assert isinstance(err, InvalidArgument) and err.field == "max_tokens"
    assert str(err) == "max_tokens: must be >= 1"


def test_internal_types_pickle():
    req = InternalRequest("r1", "m", (1, 2, 3), SamplingParams(max_tokens=4), "s", None, 10.0)
    assert pickle.loads(pickle.dumps(req)) == req


def test_as_service_error_unwraps_ray_style_wrappers():
    class RayTaskError(Exception):  # what Ray raises for an exception inside a replica
        def __init__(self, cause):
            super().__init__(str(cause))
            self.cause = cause

    original = api.ResourceExhausted("decode KV full")
    assert as_service_error(RayTaskError(original)) is original
    ActorDiedError = type("ActorDiedError", (Exception,), {})
    assert isinstance(as_service_error(ActorDiedError("gone")), Unavailable)
    assert isinstance(as_service_error(TimeoutError()), api.DeadlineExceeded)
    assert isinstance(as_service_error(ValueError("bug")), api.Internal)


def test_worker_ref_key_round_trip_and_strict_names():
    ref = WorkerRef("decode", "decode-0", "inc1")
    assert WorkerRef.from_key(ref.key) == ref
    with pytest.raises(ValueError):
        WorkerRef("decode", "bad|id", "inc1")
    with pytest.raises(ValueError):
        WorkerRef("router", "r", "inc1")  # type: ignore[arg-type]


def test_worker_stats_json_round_trip_is_strict():
    stats = WorkerStats("p0", "i0", "prefill", queued_prefill_tokens=5, running=1)
    assert WorkerStats.from_json(stats.to_json()) == stats
    with pytest.raises(ValueError):
        WorkerStats.from_json('{"worker_id": "p0"}')


def test_request_needs_prompt_and_id():
    with pytest.raises(InvalidArgument) as info:
        InternalRequest("r", "m", ())
    assert info.value.field == "prompt"
    req = InternalRequest("r", "m", (1,), deadline_unix_s=100.0)
    assert req.remaining_s(now_unix_s=99.5) == pytest.approx(0.5)
    assert InternalRequest("r", "m", (1,)).remaining_s() is None
