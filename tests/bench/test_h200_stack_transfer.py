"""The stack bench's transfer phase against a fake stack: a warm-up push first, distinct prompts
for every repeat (a repeated prompt would hit the decode worker's prefix cache and push almost
nothing), medians of e2e and transport GB/s, the pushes' split, and summary.json's fields."""

import asyncio
import json
import types

import pytest

import flashpd_sdk
from flashpd.bench import h200_stack as hs


class _Stream:
    def __init__(self, result):
        self.result = result

    def __aiter__(self):
        async def chunks():
            yield types.SimpleNamespace(token_ids=[1])

        return chunks()


class _Stack:
    """Each request's push takes 2 + n/8192 ms end to end, 1 + n/16384 ms on the wire."""

    grpc_target = "fake:0"

    def __init__(self):
        self.prompts: list[tuple[int, ...]] = []
        self.records: list[dict] = [{"total_ms": 30.0, "bytes": 1}]  # the run's first push (greedy)

    def client(self, target):
        stack = self

        class Client:
            def generate(self, prompt_ids, **kw):
                n = len(prompt_ids)
                stack.prompts.append(tuple(prompt_ids))
                e2e_ms, wire_ms = 2 + n / 8192, 1 + n / 16384
                stack.records.append(
                    {"bytes": -(-n // 128) * hs.BYTES_PER_BLOCK, "wire_ms": wire_ms, "total_ms": e2e_ms}
                    | {"hop_ms": 0.0, "post_ms": 0.1, "inline": True, "phases": {"done_ms": 0.2, "polls": 3}}
                )
                return _Stream(types.SimpleNamespace(timeline={"transfer_ms": e2e_ms, "first_token_ms": 9.0}))

            async def close(self):
                pass

        return Client()

    def push_records(self):
        return list(self.records)


def test_transfer_phase_warms_up_then_pushes_distinct_prompts_and_reports_medians(monkeypatch, tmp_path):
    stack = _Stack()
    monkeypatch.setattr(flashpd_sdk, "AsyncClient", stack.client)
    monkeypatch.setattr(hs, "TRANSFER_PROMPTS", (256, 1024))
    out = asyncio.run(hs.phase_transfer(stack))
    assert len(stack.prompts) == 1 + 2 * hs.TRANSFER_REPEATS
    assert len(set(stack.prompts)) == len(stack.prompts)  # no repeat is a prefix hit
    assert len(stack.prompts[0]) == hs.TRANSFER_WARMUP_PROMPT
    assert out["first_push_ms"] == 30.0  # the run's very first push, not the warm-up
    big = out["1024"]
    assert big["repeats"] == hs.TRANSFER_REPEATS and big["pushed_all_blocks"]
    assert big["transfer_ms"] == 2.125 and big["wire_ms"] == 1.062
    assert big["gb_s"] == round(8 * hs.BYTES_PER_BLOCK / 2.125 / 1e6, 1)
    assert big["split_ms"] == {"hop_ms": 0.0, "post_ms": 0.1, "done_ms": 0.2, "polls": 3}
    (tmp_path / "results.json").write_text(json.dumps({"transfer": {"8192": big}}))
    s = hs.summary(str(tmp_path), "abc1234")
    assert s["transfer_gb_s"]["8192"] == big["gb_s"] and s["transfer_gb_s"]["32768"] is None
    assert s["transfer_gb_s_transport"]["8192"] == big["gb_s_transport"] > big["gb_s"]
    assert s["push_split_ms"]["8192"]["done_ms"] == 0.2


def test_set_overrides_the_apps_args_in_a_copy_of_the_config(tmp_path):
    from pathlib import Path

    import yaml

    from flashpd.bench.h200_stack import config_with
    from flashpd.services.app import AppArgs

    src = str(Path(__file__).resolve().parents[2] / "infra" / "serve.h200.yaml")
    assert config_with(src, [], str(tmp_path)) == src
    path = config_with(src, ["kv_push_early=true", "kv_lease_s=120"], str(tmp_path))
    (app,) = yaml.safe_load(open(path).read())["applications"]
    assert app["args"]["kv_push_early"] is True and app["args"]["kv_lease_s"] == 120
    (orig,) = yaml.safe_load(open(src).read())["applications"]
    assert {k: v for k, v in app["args"].items() if k not in ("kv_push_early", "kv_lease_s")} == {
        k: v for k, v in orig["args"].items() if k != "kv_lease_s"
    }
    assert AppArgs.model_validate(app["args"]).worker_config("prefill", "redis://127.0.0.1:1/0").push_early
    with pytest.raises(SystemExit, match="key=value"):
        config_with(src, ["kv_push_early"], str(tmp_path))
