"""The synchronous Client against a scripted server: results, typed errors, retry, resume."""

import threading

import grpc
import pytest
from sdk_fakes import COMPLETE, OUTPUT, PREFILL_CREDIT, ScriptedServer, Step, self_signed_cert

from flashpd_sdk import (
    Cancelled,
    Client,
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    RetryPolicy,
    Unavailable,
)

pytestmark = pytest.mark.net
FAST = RetryPolicy(backoff_s=0.01)
UNAVAILABLE = Step(fail=grpc.StatusCode.UNAVAILABLE, tokens=0)


def test_generate_yields_chunks_then_a_result(server):
    with Client(server.target) as client:
        stream = client.generate(prompt_ids=[1, 2, 3], max_tokens=11, session_id="s")
        chunks = list(stream)
        result = stream.result
    assert [c.index for c in chunks] == list(range(len(OUTPUT)))
    assert result.output_ids == tuple(OUTPUT) and result.text == "hello world"
    assert result.finish_reason == "length"
    assert (result.usage.cached_tokens, result.usage.cached_tokens_decode) == (1, 2)
    assert result.timeline["e2e_ms"] == 9.0 and set(result.timeline) >= {"route_ms", "replay_ms"}
    assert (result.prefill_worker, result.decode_worker) == ("p0", "d0")
    sent = server.requests[0]
    assert sent.session_id == "s" and sent.max_tokens == 11 and sent.temperature == 0.0
    assert list(sent.prompt_ids.ids) == [1, 2, 3] and len(sent.request_id) == 32


def test_result_drains_an_unread_stream(server):
    with Client(server.target) as client:
        assert client.generate(prompt="hi").result.text == "hello world"


@pytest.mark.parametrize(
    "code,error",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
        (grpc.StatusCode.CANCELLED, Cancelled),
        (grpc.StatusCode.INTERNAL, InternalError),
        (grpc.StatusCode.UNIMPLEMENTED, InternalError),
    ],
)
def test_status_codes_map_to_typed_errors(server, code, error):
    server.play(Step(fail=code, tokens=0))
    with Client(server.target) as client, pytest.raises(error) as info:
        _ = client.generate(prompt="x").result
    assert info.value.code == code
    assert len(server.requests) == 1  # none of these is retried


def test_invalid_argument_carries_the_field(server):
    server.play(Step(fail=grpc.StatusCode.INVALID_ARGUMENT, tokens=0, field="max_tokens"))
    with Client(server.target) as client, pytest.raises(InvalidArgument) as info:
        _ = client.generate(prompt="x").result
    assert info.value.field == "max_tokens"


def test_unavailable_before_the_first_token_is_retried_with_the_same_id(server):
    server.play(UNAVAILABLE, UNAVAILABLE, COMPLETE)
    with Client(server.target, retry=FAST) as client:
        result = client.generate(prompt="x").result
    assert result.text == "hello world" and result.retries == 2
    assert len({r.request_id for r in server.requests}) == 1
    assert [r.resume_from_token for r in server.requests] == [0, 0, 0]


def test_retries_are_bounded(server):
    server.play(UNAVAILABLE, UNAVAILABLE, COMPLETE)
    with Client(server.target, retry=RetryPolicy(max_retries=1, backoff_s=0.01)) as client:
        with pytest.raises(Unavailable):
            _ = client.generate(prompt="x").result
    assert len(server.requests) == 2


def test_broken_stream_resumes_from_the_tokens_received(server):
    server.play(Step(fail=grpc.StatusCode.UNAVAILABLE, tokens=4), COMPLETE)
    with Client(server.target, retry=FAST) as client:
        stream = client.generate(prompt="x")
        chunks = list(stream)
    assert [c.index for c in chunks] == list(range(len(OUTPUT)))
    assert stream.result.text == "hello world" and stream.result.resumes == 1
    assert [r.resume_from_token for r in server.requests] == [0, 4]


def test_unresumable_stream_reports_the_break(server):
    server.play(Step(fail=grpc.StatusCode.UNAVAILABLE, tokens=4), Step(fail=grpc.StatusCode.INVALID_ARGUMENT, tokens=0))
    with Client(server.target, retry=FAST) as client:
        stream = client.generate(prompt="x")
        got = []
        with pytest.raises(Unavailable, match="scripted UNAVAILABLE"):
            for chunk in stream:
                got.append(chunk)
    assert len(got) == 4 and [r.resume_from_token for r in server.requests] == [0, 4]


def test_resume_refused_by_a_router_that_forgot_the_stream_continues_from_prompt_ids(server):
    server.play(
        Step(fail=grpc.StatusCode.UNAVAILABLE, tokens=4), Step(fail=grpc.StatusCode.NOT_FOUND, tokens=0), COMPLETE
    )
    with Client(server.target, retry=FAST) as client:
        stream = client.generate(prompt_ids=[1, 2, 3], max_tokens=11, request_id="q")
        chunks = list(stream)
    assert [c.index for c in chunks] == list(range(len(OUTPUT)))
    assert stream.result.output_ids == tuple(OUTPUT)
    cont = server.requests[2]
    assert list(cont.prompt_ids.ids) == [1, 2, 3] and list(cont.continue_ids.ids) == [*OUTPUT[:4]]
    assert cont.max_tokens == 7 and cont.request_id == "q@c1" and cont.resume_from_token == 0
    assert cont.continue_prefill_credit_tokens == PREFILL_CREDIT


def test_text_prompt_stream_the_router_forgot_continues_from_the_same_text(server):
    server.play(
        Step(fail=grpc.StatusCode.UNAVAILABLE, tokens=4),
        Step(fail=grpc.StatusCode.NOT_FOUND, tokens=0),
        Step(fail=grpc.StatusCode.UNAVAILABLE, tokens=3),  # the continuation breaks too
        Step(fail=grpc.StatusCode.NOT_FOUND, tokens=0),
        COMPLETE,
    )
    with Client(server.target, retry=FAST) as client:
        stream = client.generate(prompt="tell me", max_tokens=11, request_id="t")
        chunks = list(stream)
    assert [c.index for c in chunks] == list(range(len(OUTPUT)))
    assert stream.result.output_ids == tuple(OUTPUT) and stream.result.text == "hello world"
    first, second = server.requests[2], server.requests[4]
    assert first.prompt == "tell me" and list(first.continue_ids.ids) == [*OUTPUT[:4]]
    assert second.prompt == "tell me" and list(second.continue_ids.ids) == [*OUTPUT[:7]]
    assert (second.max_tokens, second.request_id) == (4, "t@c2")
    assert second.continue_prefill_credit_tokens == PREFILL_CREDIT


def test_api_key_is_sent_as_bearer_metadata_on_every_call(server):
    with Client(server.target, api_key="k-123") as client:
        stream = client.generate(prompt="x")
        next(iter(stream))
        stream.cancel()
    assert server.metadata and all(m.get("authorization") == "Bearer k-123" for m in server.metadata)
    with pytest.raises(InvalidArgument) as info:
        Client(server.target, api_key="has space")
    assert info.value.field == "api_key"


def test_tls_with_a_root_certificate_file(tmp_path):
    cert, key = self_signed_cert()
    (tmp_path / "ca.pem").write_bytes(cert)
    with ScriptedServer(tls=(cert, key)) as tls_server:
        with Client(tls_server.target, tls=str(tmp_path / "ca.pem")) as client:
            assert client.generate(prompt="x").result.text == "hello world"
        with Client(tls_server.target, retry=RetryPolicy(max_retries=0)) as plain:
            with pytest.raises(Unavailable):
                _ = plain.generate(prompt="x").result  # plaintext to a TLS port fails
    with pytest.raises(InvalidArgument) as info:
        Client("127.0.0.1:1", tls=str(tmp_path / "missing.pem"))
    assert info.value.field == "tls"


def test_deadline_is_sent_and_enforced(server):
    server.play(Step(delay_s=0.2))
    with Client(server.target) as client, pytest.raises(DeadlineExceeded):
        _ = client.generate(prompt="x", timeout_s=0.3).result


def test_cancel_stops_the_stream_and_aborts_on_the_server(server):
    server.play(Step(delay_s=0.05))
    with Client(server.target) as client:
        stream = client.generate(prompt="x", request_id="mine")
        next(stream)
        threading.Timer(0.01, stream.cancel).start()
        with pytest.raises(Cancelled):
            for _ in stream:
                continue
    assert server.servicer.aborts == ["mine"]
    assert server.servicer.cancelled.wait(2.0)


def test_abort_health_and_models(server):
    with Client(server.target) as client:
        assert client.abort("r9") is True
        assert client.health() == "SERVING"
        with pytest.raises(NotFound):
            client.health("unknown.Service")
        assert [(m.id, m.context_tokens) for m in client.models()] == [("m", 64)]
    assert server.servicer.aborts == ["r9"]


def test_prompt_xor_prompt_ids():
    with Client("127.0.0.1:1") as client:
        with pytest.raises(InvalidArgument) as info:
            client.generate(prompt="a", prompt_ids=[1])
        assert info.value.field == "prompt"
        with pytest.raises(InvalidArgument):
            client.generate()
