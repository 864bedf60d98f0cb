"""Edge conversion: proto round trips and the validation matrix shared by both frontends."""

import pytest
from router_fakes import SERVED, ByteTokenizer

from flashpd.services.api import FinalEvent, InvalidArgument, SamplingParams, Timeline, TokenEvent, TokenLogprobs, Usage
from flashpd.services.router import convert
from flashpd.services.router.convert import ModelTable, ServedModel, request_from_proto
from flashpd.services.router.validation import ModelNotFound
from flashpd_sdk._gen import flashpd_pb2 as pb

MODELS = ModelTable([SERVED])
TOK = ByteTokenizer()


def test_token_event_round_trip():
    ev = TokenEvent((5, 6), 3, (TokenLogprobs(-0.5, ((5, -0.5), (9, -1.25))), TokenLogprobs(-1.0)), "hi")
    back = convert.token_event_from_proto(convert.token_event_to_proto(ev))
    assert back == ev


def test_first_token_event_carries_the_prefill_credit():
    ev = TokenEvent((5,), 0, (), "a", prefill_credit_tokens=256)
    msg = convert.token_event_to_proto(ev)
    assert msg.prefill_credit_tokens == 256 and convert.token_event_from_proto(msg) == ev
    assert not convert.token_event_to_proto(TokenEvent((6,), 1)).HasField("prefill_credit_tokens")


def test_continue_ids_make_a_continuation_of_the_original_prompt():
    msg = pb.GenerateRequest(
        prompt="hey", continue_ids=pb.TokenIds(ids=[9, 8]), continue_prefill_credit_tokens=0, max_tokens=5
    )
    req = request_from_proto(msg, MODELS, TOK, timeout_s=None).request
    assert req.prompt_ids == tuple(b"hey") + (9, 8) and req.kv_prompt_ids == tuple(b"hey")
    assert req.kv_prompt_tokens == 3 and req.max_prefill_credit_tokens == 0
    plain = request_from_proto(pb.GenerateRequest(prompt="hey"), MODELS, TOK, timeout_s=None)
    assert plain.request.kv_prompt_tokens is None


def test_final_event_round_trip():
    ev = FinalEvent("length", Usage(10, 4, 3, 2, 1), Timeline(1, 2, 3, 4, 5, 6, 7, 8), "p0", "d0", "req", "tail")
    assert convert.final_from_proto(convert.final_to_proto(ev)) == ev


def test_sampling_round_trip():
    p = SamplingParams(
        max_tokens=9,
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        min_p=0.05,
        seed=3,
        stop_token_ids=(1,),
        stop=("x",),
        ignore_eos=True,
        logprobs=2,
    )
    msg = pb.GenerateRequest()
    convert.sampling_to_proto(p, msg)
    assert convert.sampling_from_proto(msg, SERVED.vocab_size) == p


def test_defaults_when_fields_are_unset():
    edge = request_from_proto(pb.GenerateRequest(prompt="hi"), MODELS, TOK, timeout_s=None)
    assert edge.request.sampling == SamplingParams(max_tokens=16)
    assert edge.request.model == SERVED.name and not edge.resumable
    assert edge.request.deadline_unix_s is None


def test_client_id_makes_a_request_resumable_and_deadline_is_absolute():
    msg = pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=[1, 2]), request_id="abc", resume_from_token=4, session_id="s")
    edge = request_from_proto(msg, MODELS, TOK, timeout_s=2.5, now_unix_s=100.0)
    assert edge.resumable and edge.resume_from_token == 4
    assert edge.request.deadline_unix_s == 102.5 and edge.request.session_id == "s"
    msg.resume_from_token = 0
    assert request_from_proto(msg, MODELS, TOK, timeout_s=None).fingerprint == edge.fingerprint


@pytest.mark.parametrize(
    "msg,field",
    [
        (pb.GenerateRequest(), "prompt"),
        (pb.GenerateRequest(prompt=""), "prompt"),
        (pb.GenerateRequest(prompt_ids=pb.TokenIds()), "prompt_ids"),
        (pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=[300])), "prompt_ids"),
        (pb.GenerateRequest(prompt="x", model="nope"), "model"),
        (pb.GenerateRequest(prompt="x", max_tokens=-1), "max_tokens"),
        (pb.GenerateRequest(prompt="x", max_tokens=0), "max_tokens"),
        (pb.GenerateRequest(prompt="x" * 3000), "prompt"),
        (pb.GenerateRequest(prompt="x" * 2000, max_tokens=100), "max_tokens"),
        (pb.GenerateRequest(prompt="x", temperature=-1), "temperature"),
        (pb.GenerateRequest(prompt="x", top_p=1.5), "top_p"),
        (pb.GenerateRequest(prompt="x", logprobs=50), "logprobs"),
        (pb.GenerateRequest(prompt="x", request_id="has space"), "request_id"),
        (pb.GenerateRequest(prompt="x", session_id="s" * 200), "session_id"),
        (pb.GenerateRequest(prompt="x", session_id="caf\u00e9"), "session_id"),
        (pb.GenerateRequest(prompt="x", temperature=float("nan")), "temperature"),
        (pb.GenerateRequest(prompt="x", temperature=float("inf")), "temperature"),
        (pb.GenerateRequest(prompt="x", top_p=float("nan")), "top_p"),
        (pb.GenerateRequest(prompt="x", min_p=float("-inf")), "min_p"),
        (pb.GenerateRequest(prompt="x", seed=2**63), "seed"),
        (pb.GenerateRequest(prompt="x", seed=2**64 - 1), "seed"),
        (pb.GenerateRequest(prompt="x", top_k=257), "top_k"),
        (pb.GenerateRequest(prompt="x", top_k=-2), "top_k"),
        (pb.GenerateRequest(prompt="x", stop_token_ids=[256]), "stop_token_ids"),
        (pb.GenerateRequest(prompt="x", stop_token_ids=[2**32 - 1]), "stop_token_ids"),
        (pb.GenerateRequest(prompt="x", stop=[""]), "stop"),
        (pb.GenerateRequest(prompt="x", stop=["s"] * 17), "stop"),
        (pb.GenerateRequest(prompt="x", logprobs=21), "logprobs"),
        (pb.GenerateRequest(prompt="x" * 200_000), "prompt"),  # refused before tokenizing
        (pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=[1] * 3000)), "prompt_ids"),
        (pb.GenerateRequest(prompt="x", continue_ids=pb.TokenIds(ids=[256])), "continue_ids"),
        (pb.GenerateRequest(prompt="x", continue_ids=pb.TokenIds(ids=[1] * 2050), max_tokens=16), "continue_ids"),
        (pb.GenerateRequest(prompt="x", continue_prefill_credit_tokens=5), "continue_prefill_credit_tokens"),
    ],
)
def test_bad_requests_name_the_field(msg, field):
    with pytest.raises(InvalidArgument) as info:
        request_from_proto(msg, MODELS, TOK, timeout_s=None)
    assert info.value.field == field


def test_model_table_resolves_default_and_rejects_unknown():
    table = ModelTable([ServedModel("a", 10, 10), ServedModel("b", 10, 10)])
    assert table.resolve("").name == "a" and table.resolve("b").name == "b"
    with pytest.raises(ModelNotFound, match="does not exist") as info:
        table.resolve("c")
    assert info.value.field == "model" and info.value.http_status == 404
    assert info.value.code == "INVALID_ARGUMENT"  # gRPC keeps INVALID_ARGUMENT for a bad field


def test_developer_role_is_a_system_message():
    as_developer = convert.deepseek_chat_prompt(
        [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    as_system = convert.deepseek_chat_prompt(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert as_developer == as_system


def test_deepseek_chat_template():
    text = convert.deepseek_chat_prompt(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": [{"type": "text", "text": "Again"}]},
        ]
    )
    assert text == (
        "<|begin_of_sentence|>Be brief.<|User|>Hi<|Assistant|>Hello<|end_of_sentence|><|User|>Again<|Assistant|>"
    )


@pytest.mark.parametrize(
    "messages,field",
    [
        ([], "messages"),
        ([{"role": "function", "content": "x"}], "messages[0].role"),
        ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
        (["hi"], "messages[0]"),
        ([{"role": "user", "content": "a\ud800"}], "messages[0].content"),
        ([{"role": ["user"], "content": "x"}], "messages[0].role"),
        ([{"role": "assistant", "content": "x", "tool_calls": "x"}], "messages[0].tool_calls"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
        ([{"role": "user", "content": "x", "name": 3}], "messages[0].name"),
    ],
)
def test_chat_template_errors_name_the_message(messages, field):
    with pytest.raises(InvalidArgument) as info:
        convert.deepseek_chat_prompt(messages)
    assert info.value.field == field


@pytest.mark.parametrize("temperature", [1.4e-45, 1e-38, 9e-6])
def test_grpc_tiny_temperature_is_greedy(temperature):
    msg = pb.GenerateRequest(prompt="x", temperature=temperature, top_p=0.5)
    sampling = request_from_proto(msg, MODELS, TOK, timeout_s=None).request.sampling
    assert sampling.temperature == 0.0 and sampling.top_p == 1.0


def test_grpc_largest_seed_is_accepted():
    msg = pb.GenerateRequest(prompt="x", seed=2**63 - 1, temperature=0.5, top_k=-1)
    sampling = request_from_proto(msg, MODELS, TOK, timeout_s=None).request.sampling
    assert sampling.seed == 2**63 - 1 and sampling.top_k == 0 and sampling.temperature == 0.5
