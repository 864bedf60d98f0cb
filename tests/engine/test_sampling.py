import pytest
import torch

from flashpd.engine.sampling import Sampler, SamplingError, SamplingParams


def _logits(v=32, seed=0):
    return torch.randn(1, v, generator=torch.Generator().manual_seed(seed))


def test_greedy_picks_argmax():
    logits = _logits()
    out = Sampler().sample(logits, ["a"], [SamplingParams()])
    assert out[0].token_id == int(logits.argmax())


def test_seeded_sampling_is_reproducible_and_independent_of_neighbours():
    logits = _logits(seed=1).repeat(3, 1)
    p = SamplingParams(temperature=1.0, seed=7)
    alone = [Sampler(seed=0).sample(logits[:1], ["r"], [p])[0].token_id for _ in range(1)]
    s = Sampler(seed=123)
    batched = s.sample(logits, ["x", "r", "y"], [SamplingParams(temperature=1.0), p,
                                                   SamplingParams(temperature=2.0)])
    assert batched[1].token_id == alone[0]
    seq1 = [Sampler().sample(logits[:1], ["r"], [p])[0].token_id]
    s2 = Sampler()
    seq2 = [s2.sample(logits[:1], ["r"], [p])[0].token_id for _ in range(5)]
    s3 = Sampler()
    seq3 = [s3.sample(logits[:1], ["r"], [p])[0].token_id for _ in range(5)]
    assert seq2 == seq3 and seq2[0] == seq1[0]


def test_top_k_one_is_greedy():
    logits = _logits(seed=2)
    out = Sampler().sample(logits, ["a"], [SamplingParams(temperature=5.0, top_k=1, seed=3)])
    assert out[0].token_id == int(logits.argmax())


def test_top_p_tiny_keeps_only_best():
    logits = _logits(seed=4)
    for seed in range(5):
        out = Sampler().sample(logits, ["a"], [SamplingParams(temperature=1.0, top_p=1e-6, seed=seed)])
        assert out[0].token_id == int(logits.argmax())


def test_min_p_one_keeps_only_best():
    logits = _logits(seed=5)
    out = Sampler().sample(logits, ["a"], [SamplingParams(temperature=1.0, min_p=1.0, seed=1)])
    assert out[0].token_id == int(logits.argmax())


def test_top_n_logprobs_sorted_and_normalised():
    logits = _logits(seed=6)
    out = Sampler().sample(logits, ["a"], [SamplingParams(logprobs=3)])[0]
    lps = [lp for _, lp in out.top_logprobs]
    assert lps == sorted(lps, reverse=True) and len(lps) == 3
    assert out.top_logprobs[0][0] == out.token_id
    assert abs(out.logprob - float(torch.log_softmax(logits[0], -1).max())) < 1e-6


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -1.0),
                                         ("top_p", 0.0), ("min_p", 2.0), ("top_k", -1)])
def test_bad_params_name_the_field(field, value):
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**{field: value})


def test_from_dict_rejects_unknown_field():
    with pytest.raises(SamplingError, match="bogus"):
        SamplingParams.from_dict({"bogus": 1})
