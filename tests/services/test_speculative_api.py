"""Speculative decoding at the edges: per-request `speculative` (HTTP body field and gRPC field
70), usage (OpenAI completion_tokens_details + the flashpd extension, proto Usage 70-73), the
router's Prometheus counters, the Serve config section, and the P/D contract check."""

from __future__ import annotations

import pytest

from flashpd.engine.kv_pools import KVPools
from flashpd.engine.speculative import BENCH_ENV
from flashpd.engine.transfer.contract import ContractMismatch, check_compatible
from flashpd.model.presets import preset_config
from flashpd.services.api import FinalEvent, InvalidArgument, Usage
from flashpd.services.app import AppArgs
from flashpd.services.router import convert
from flashpd.services.router import validation as v
from flashpd.services.router.metrics import RouterMetrics
from flashpd.services.router.openai_compat import flashpd_extension, usage
from flashpd.services.worker.common import transfer_contract
from flashpd_sdk._gen import flashpd_pb2 as pb


def _params(body: dict):
    return v.sampling_params(body.get, max_tokens=4, logprobs=0, vocab_size=512, defaults=v.OPENAI_DEFAULTS)


def test_http_field_speculative():
    assert _params({}).speculative == "auto"
    assert _params({"speculative": "off"}).speculative == "off"
    assert _params({"speculative": ""}).speculative == "auto"
    for bad in ("no", 0, True, ["off"]):
        with pytest.raises(InvalidArgument) as info:
            _params({"speculative": bad})
        assert info.value.field == "speculative"


def test_grpc_field_speculative_round_trip():
    msg = pb.GenerateRequest()
    assert convert.sampling_from_proto(msg, 512).speculative == "auto"
    msg.speculative = "off"
    p = convert.sampling_from_proto(msg, 512)
    assert p.speculative == "off"
    out = pb.GenerateRequest()
    convert.sampling_to_proto(p, out)
    assert out.speculative == "off" and pb.GenerateRequest.DESCRIPTOR.fields_by_name["speculative"].number == 70
    msg.speculative = "sometimes"
    with pytest.raises(InvalidArgument) as info:
        convert.sampling_from_proto(msg, 512)
    assert info.value.field == "speculative"


def _final(**kw) -> FinalEvent:
    return FinalEvent(finish_reason="stop", usage=Usage(prompt_tokens=5, completion_tokens=9, **kw))


def test_usage_reports_drafts():
    final = _final(draft_tokens=10, accepted_draft_tokens=6, draft_steps=2)
    u = usage(final)
    assert u["completion_tokens_details"] == {"accepted_prediction_tokens": 6, "rejected_prediction_tokens": 4}
    ext = flashpd_extension(final)["speculative"]
    assert ext["acceptance_length"] == 4.0 and "forced_acceptance_length" not in ext
    forced = flashpd_extension(
        _final(draft_tokens=5, accepted_draft_tokens=3, draft_steps=1, forced_acceptance_length=3.5)
    )["speculative"]
    assert forced["forced_acceptance_length"] == 3.5
    back = convert.final_from_proto(convert.final_to_proto(final))
    assert back.usage == final.usage


def test_router_metrics_count_drafts():
    m = RouterMetrics("tiny")
    m.on_final(_final(draft_tokens=10, accepted_draft_tokens=6, draft_steps=2))
    m.on_final(_final(forced_acceptance_length=3.5))
    text = m.exposition().decode()
    assert 'flashpd:spec_decode_draft_tokens_total{model_name="tiny"} 10.0' in text
    assert 'flashpd:spec_decode_accepted_tokens_total{model_name="tiny"} 6.0' in text
    assert 'flashpd:spec_decode_acceptance_length_bucket{le="4.0",model_name="tiny"} 1.0' in text
    assert 'flashpd:spec_decode_forced_requests_total{model_name="tiny"} 1.0' in text


def _app(**spec) -> AppArgs:
    return AppArgs(checkpoint="x", redis_url="redis://127.0.0.1:1", speculative=spec or None)


def test_serve_config_section(monkeypatch):
    app = _app(method="ngram", num_tokens=3)
    assert app.worker_config("decode").engine.speculative.num_tokens == 3
    assert app.worker_config("prefill").engine.speculative is None
    assert app.worker_config("prefill").speculative == app.worker_config("decode").speculative
    with pytest.raises(ValueError, match="unknown|extra"):
        _app(method="ngram", k=3)
    monkeypatch.delenv(BENCH_ENV, raising=False)
    with pytest.raises(ValueError, match=BENCH_ENV):
        _app(method="ngram", bench_forced_acceptance_length=3.51)
    monkeypatch.setenv(BENCH_ENV, "1")
    assert (
        _app(method="ngram", bench_forced_acceptance_length=3.51)
        .worker_config("decode")
        .engine.speculative.bench_forced_acceptance_length
        == 3.51
    )


def test_serve_config_draft_graphs_switch():
    assert _app(method="dspark").worker_config("decode").engine.speculative.draft_graphs == "auto"
    assert _app(method="dspark", draft_graphs="off").worker_config("decode").engine.speculative.draft_graphs == "off"
    with pytest.raises(ValueError, match="draft_graphs"):
        _app(method="dspark", draft_graphs="static")  # the CPU tests' mode is not a serving option


def test_contract_mismatch_on_speculative_config():
    pools = KVPools(preset_config("tiny"), num_blocks=2, num_slots=1)
    spec = {"method": "dspark", "num_tokens": 5, "forced": None}
    a = transfer_contract(pools, "tiny", spec)
    check_compatible(a, transfer_contract(pools, "tiny", dict(spec)))
    with pytest.raises(ContractMismatch) as info:
        check_compatible(a, transfer_contract(pools, "tiny", None))
    assert info.value.fields == ("speculative",)
    assert "speculative" in str(info.value)
    with pytest.raises(ContractMismatch):
        check_compatible(a, transfer_contract(pools, "tiny", dict(spec, num_tokens=3)))
    assert type(a).from_json(a.to_json()) == a
