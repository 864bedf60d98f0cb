"""With bounded replay on, a prefix hit credits the usable prefix and the last-token logits stay
within the deviation the model measured for bounded replay (benchmarks/model_cpu.py)."""

from __future__ import annotations

import torch

from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.sampling import SamplingParams

# benchmarks/model_cpu.py, tiny preset FP32: decode-side replay of a 400-token prompt, the larger of
# the two bounded-replay approximations it measured.
MODEL_MAX_ABS_DLOGIT = 1.964
MODEL_KL = 0.120


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _last_logits(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[torch.Tensor, int]:
    captured = {}
    sample = engine.sampler.launch

    def capture(logits, rids, params, bitmask=None):  # seam: keep the logits sampled from
        for row, r in enumerate(rids):
            captured[r] = logits[row].clone()
        return sample(logits, rids, params, bitmask)

    engine.sampler.launch = capture
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1))
    cached = 0
    while engine.has_unfinished():
        for o in engine.step():
            cached = o.cached_tokens
    engine.sampler.launch = sample
    return captured[rid], cached


def test_bounded_replay_credit_and_deviation(model_f32):
    base = _prompt(256, 60)
    prompt = base + _prompt(144, 61)  # 400 tokens, hit of 2 chunks
    cold, _ = _last_logits(LLMEngine(model_f32, EngineConfig(num_blocks=32)), "cold", prompt)
    engine = LLMEngine(model_f32, EngineConfig(num_blocks=32))
    _last_logits(engine, "warmup", base)
    warm, cached = _last_logits(engine, "warm", prompt)
    assert cached == 128  # align_down(256, 128) - 128
    dmax = float((warm - cold).abs().max())
    kl = float(
        torch.nn.functional.kl_div(
            torch.log_softmax(warm, -1), torch.log_softmax(cold, -1), log_target=True, reduction="sum"
        )
    )
    print(f"bounded replay after a 256-token hit: max|dlogit|={dmax:.4f} KL={kl:.2e}")
    assert dmax <= MODEL_MAX_ABS_DLOGIT and kl <= MODEL_KL, (dmax, kl)
    assert dmax > 0  # a real approximation, not a silent cold recompute
