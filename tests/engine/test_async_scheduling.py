"""Async scheduling: decode step N+1 planned and launched before step N's ids reach the host.

The engine with `async_scheduling` on must give every request the same tokens, finish reasons
and block accounting as with it off (greedy, seeded draws, EOS and stop ids mid-batch, length
caps, aborts between calls, arrivals while a step is in flight), and the Engram hash of a row
whose id is read on the device must equal the host's.
"""

from __future__ import annotations

import torch

from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.sampling import SamplingParams


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(model, on: bool, eos: int | None = None, **kw) -> LLMEngine:
    cfg = EngineConfig(num_blocks=64, async_scheduling=on, **kw)
    return LLMEngine(model, cfg, eos_token_id=eos)


def _drive(
    engine: LLMEngine, requests: dict, arrivals: dict | None = None, aborts: dict | None = None
) -> dict[str, dict]:
    """Run to completion; arrivals / aborts: call index -> request ids added / aborted then."""
    out: dict[str, dict] = {}
    arrivals, aborts = dict(arrivals or {}), dict(aborts or {})
    for rid in requests:
        if not any(rid in v for v in arrivals.values()):
            engine.add_request(rid, *requests[rid])
    call = 0
    while engine.has_unfinished() or any(k >= call for k in arrivals):
        for rid in arrivals.pop(call, []):
            engine.add_request(rid, *requests[rid])
        for rid in aborts.pop(call, []):
            engine.abort(rid)
            out.setdefault(rid, {"ids": []})["reason"] = "abort"
        for o in engine.step():
            r = out.setdefault(o.request_id, {"ids": []})
            r["ids"].extend(o.new_token_ids)
            assert "reason" not in r, f"{o.request_id} got output after it finished"
            if o.finished:
                r["reason"] = o.finish_reason
        call += 1
        assert call < 500
    return out


def _same(model, requests, eos=None, **drive) -> tuple[dict, LLMEngine]:
    """Both engines on the same calls: equal outputs (an aborted request's: a prefix of what
    it gives unaborted, as the abort lands after a different number of tokens), every block
    accounted the same at the end, and steps actually planned ahead."""
    runs = []
    for on in (False, True):
        engine = _engine(model, on, eos)
        runs.append((_drive(engine, requests, **drive), engine))
    (sync, sync_engine), (ahead, engine) = runs
    aborted = {rid for ids in drive.get("aborts", {}).values() for rid in ids}
    full = _drive(_engine(model, False, eos), requests) if aborted else sync
    for rid in requests:
        if rid in aborted:
            assert ahead[rid]["reason"] == "abort"
            assert ahead[rid]["ids"] == full[rid]["ids"][: len(ahead[rid]["ids"])]
        else:
            assert ahead[rid] == sync[rid], rid
    assert engine.num_ahead_steps > 0, "no step was planned ahead"
    usage = engine.usage()
    assert usage["running"] == 0 and usage["waiting"] == 0 and not engine.has_unfinished()
    assert engine.kv.usage() == sync_engine.kv.usage()
    return ahead, engine


def test_greedy_and_length_caps_match_the_sync_engine(model_f32):
    requests = {f"r{i}": (_prompt(20 + 7 * i, i), SamplingParams(max_tokens=3 + 2 * i)) for i in range(4)}
    out, _ = _same(model_f32, requests)
    assert [len(out[f"r{i}"]["ids"]) for i in range(4)] == [3, 5, 7, 9]
    assert all(r["reason"] == "length" for r in out.values())


def test_seeded_draws_and_logprobs_match_the_sync_engine(model_f32):
    requests = {
        f"s{i}": (_prompt(30, 10 + i), SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=7 + i, logprobs=2))
        for i in range(3)
    }
    _same(model_f32, requests)


def test_eos_and_stop_ids_mid_batch_drop_the_extra_row(model_f32):
    base = {f"e{i}": (_prompt(25, 20 + i), SamplingParams(max_tokens=12)) for i in range(3)}
    greedy = _drive(_engine(model_f32, False), base)
    eos = greedy["e0"]["ids"][3]  # e0 stops on its 4th token; the others may too, later
    stop = greedy["e1"]["ids"][5]
    requests = dict(base)
    requests["e1"] = (base["e1"][0], SamplingParams(max_tokens=12, stop_token_ids=[stop]))
    out, _ = _same(model_f32, requests, eos=eos)
    assert out["e0"]["reason"] == "stop" and len(out["e0"]["ids"]) <= 4
    assert out["e1"]["reason"] == "stop"


def test_abort_and_arrival_while_a_step_is_in_flight(model_f32):
    requests = {f"a{i}": (_prompt(22, 30 + i), SamplingParams(max_tokens=10)) for i in range(4)}
    out, _ = _same(model_f32, requests, arrivals={4: ["a3"]}, aborts={3: ["a1"], 6: ["a3"]})
    assert out["a1"]["reason"] == "abort" and out["a3"]["reason"] == "abort"
    assert out["a0"]["reason"] == "length" and len(out["a0"]["ids"]) == 10


def test_preemption_under_memory_pressure_matches(model_f32):
    requests = {f"p{i}": (_prompt(100, 40 + i), SamplingParams(max_tokens=40)) for i in range(3)}
    results = []
    for on in (False, True):
        engine = LLMEngine(model_f32, EngineConfig(num_blocks=4, async_scheduling=on))
        results.append(_drive(engine, requests))
    assert results[0] == results[1]


def test_engram_hash_of_a_device_row_equals_the_host_hash(model_f32):
    hasher = model_f32.hasher
    ids = torch.tensor(_prompt(40, 50))
    width = hasher.max_shift + 1
    windows = ids.unfold(0, width, 1)  # [T - 3, 4]: three ids before each row, then the row
    indices = list(range(len(model_f32.cfg.engram_layer_ids)))
    for index, device_rows in zip(indices, hasher.hash_windows(indices, windows), strict=True):
        host = hasher.hash_ids(index, ids[hasher.max_shift :], ids[: hasher.max_shift].tolist())
        assert torch.equal(device_rows, host)


def test_a_failing_ahead_forward_fails_its_requests_after_the_step_before(model_f32):
    engine = _engine(model_f32, True)
    real = engine.runner.execute
    faults = []

    def fail_first_ahead(plan, known, *fed):  # seam: the first forward planned ahead raises
        if fed and fed[0] is not None and not faults:
            faults.append(plan.step_id)
            raise RuntimeError("injected ahead fault")
        return real(plan, known, *fed)

    engine.runner.execute = fail_first_ahead
    requests = {f"f{i}": (_prompt(21, 60 + i), SamplingParams(max_tokens=6)) for i in range(2)}
    out: dict[str, list] = {}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).append(o)
    for rid in requests:
        reasons = [o.finish_reason for o in out[rid]]
        assert reasons[-1] == "error" and "injected ahead fault" in out[rid][-1].error
        assert reasons.count("error") == 1 and len(out[rid]) == 2  # the prompt's token, error
    usage = engine.usage()
    assert usage["blocks_free"] + usage["blocks_cached"] == usage["blocks_total"]
    engine.add_request("after", _prompt(21, 70), SamplingParams(max_tokens=4))
    after = []
    while engine.has_unfinished():
        after += engine.step()
    assert after[-1].finish_reason == "length" and engine.num_ahead_steps > 0
