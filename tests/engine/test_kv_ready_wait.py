"""A prefill-role step samples nothing, so kv_ready is the engine's only promise that the KV is in
the pools: the engine waits for the device exactly when it hands out a kv_ready output."""

from __future__ import annotations

import torch

from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.sampling import SamplingParams


def test_kv_ready_waits_for_the_device_once_per_finishing_step(model_f32, monkeypatch):
    engine = LLMEngine(model_f32, EngineConfig(role="prefill", num_blocks=64, max_num_batched_tokens=128))
    waits = []
    monkeypatch.setattr(engine, "_wait_for_kv_writes", lambda: waits.append(engine.num_steps))
    prompt = torch.randint(3, 500, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("r", prompt, SamplingParams(max_tokens=1))
    finished = []
    while engine.has_unfinished():
        outs = engine.step()
        finished += [o for o in outs if o.finished]
        if not any(o.finish_reason == "kv_ready" for o in outs):
            assert not waits or waits[-1] != engine.num_steps  # no wait on a chunk mid-prompt
    assert [o.finish_reason for o in finished] == ["kv_ready"]
    assert len(waits) == 1 and engine.num_steps >= 3  # 300 tokens in 128-token chunks, one wait


def test_kv_pending_hooks_see_the_blocks_before_the_wait_and_a_failing_hook_is_contained(model_f32, monkeypatch):
    """A prefill worker builds its push in a kv-pending hook, while the last chunk's kernels may
    still run: the hook is called with the kv_ready output's own blocks, before the wait."""
    engine = LLMEngine(model_f32, EngineConfig(role="prefill", num_blocks=64, max_num_batched_tokens=128))
    events = []
    monkeypatch.setattr(engine, "_wait_for_kv_writes", lambda: events.append(("wait", engine.num_steps)))

    def broken(request_id, blocks):
        raise RuntimeError("a hook's bug")

    engine.kv_pending_hooks += [broken, lambda rid, blocks: events.append(("pending", rid, blocks))]
    prompt = torch.randint(3, 500, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.add_request("r", prompt, SamplingParams(max_tokens=1))
    finished = []
    while engine.has_unfinished():
        finished += [o for o in engine.step() if o.finished]
    (out,) = finished
    assert out.finish_reason == "kv_ready" and len(out.kv_block_ids) == 3
    assert events == [("pending", "r", tuple(out.kv_block_ids)), ("wait", engine.num_steps)]
