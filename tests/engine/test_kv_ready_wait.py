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

    def broken(request_id, blocks, final_tokens):
        raise RuntimeError("a hook's bug")

    engine.kv_pending_hooks += [broken, lambda rid, blocks, final: events.append(("pending", rid, blocks, final))]
    prompt = torch.randint(3, 500, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.add_request("r", prompt, SamplingParams(max_tokens=1))
    finished = []
    while engine.has_unfinished():
        finished += [o for o in engine.step() if o.finished]
    (out,) = finished
    assert out.finish_reason == "kv_ready" and len(out.kv_block_ids) == 3
    # 300 tokens in 128-token chunks: the last step computes tokens 256..299, 0..255 are final
    assert events == [("pending", "r", tuple(out.kv_block_ids), 256), ("wait", engine.num_steps)]


def test_a_prefill_step_writes_no_transfer_block_before_its_first_tokens_block(model_f32):
    """What `push_early` relies on: the global KV a step writes lies in the blocks from the one
    holding its chunk's first token on, so the blocks before it are final once the earlier steps
    ran (a prefill worker writes those while the last chunk computes). Chunks of 200 tokens:
    every chunk after the first starts inside a block that the chunk before filled in part."""
    engine = LLMEngine(model_f32, EngineConfig(role="prefill", num_blocks=64, max_num_batched_tokens=200))
    groups = engine.pools.transfer_groups()  # what a push moves: group -> [blocks, bytes]
    names = list(groups)
    execute, checked = engine.runner.execute, []

    def watched(plan, *args, **kwargs):
        (chunk,) = plan.chunks
        table = engine.kv.block_table(chunk.request_id)
        first = chunk.start // 128
        before = {n: groups[n][table[: first + 1]].clone() for n in names}
        out = execute(plan, *args, **kwargs)
        after = {n: groups[n][table[: first + 1]] for n in names}
        assert all(torch.equal(before[n][:first], after[n][:first]) for n in names), chunk.start
        # ... and the test can see a write: the chunk's first block changes
        checked.append(any(not torch.equal(before[n][first], after[n][first]) for n in names))
        return out

    engine.runner.execute = watched
    prompt = torch.randint(3, 500, (900,), generator=torch.Generator().manual_seed(2)).tolist()
    engine.add_request("r", prompt, SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    assert len(checked) == 5 and all(checked)  # chunks from 0, 200, 400, 600, 800


def test_kv_pending_hooks_run_once_the_step_before_is_reached_on_the_device(model_f32, monkeypatch):
    """On a GPU the host runs ahead of the kernels: the hooks promise `final_tokens` of KV in the
    pools, so they first wait for the mark recorded after the previous step's launch (not this
    step's: its kernels are what the hook overlaps)."""
    engine = LLMEngine(model_f32, EngineConfig(role="prefill", num_blocks=64, max_num_batched_tokens=128))
    monkeypatch.setattr(engine, "_wait_for_kv_writes", lambda: None)
    events: list = []

    class Mark:
        def __init__(self, step):
            self.step = step

        def synchronize(self):
            events.append(("sync", self.step))

    monkeypatch.setattr(engine, "_new_step_mark", lambda: Mark(engine.num_steps))
    engine.kv_pending_hooks.append(lambda rid, blocks, final: events.append(("hook", final)))
    prompt = torch.randint(3, 500, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    engine.add_request("r", prompt, SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    # steps 0, 1, 2 launch chunks from 0, 128, 256; the last one's hook waits for step 1's mark
    assert events == [("sync", 1), ("hook", 256)]
