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
    batched = s.sample(logits, ["x", "r", "y"], [SamplingParams(temperature=1.0), p, SamplingParams(temperature=2.0)])
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


@pytest.mark.parametrize(
    "field,value", [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("min_p", 2.0), ("top_k", -1)]
)
def test_bad_params_name_the_field(field, value):
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**{field: value})


def test_from_dict_rejects_unknown_field():
    with pytest.raises(SamplingError, match="bogus"):
        SamplingParams.from_dict({"bogus": 1})


# ---------------------------------------------------------------- the batched draw (Gumbel-max)
def _freqs(tokens, vocab):
    return torch.bincount(torch.tensor(tokens), minlength=vocab).float() / len(tokens)


def _draw(logits_row, params, n=4000, seed=0):
    """n independent draws of one row (unseeded rows: n fresh streams in one batched call)."""
    s = Sampler(seed)
    out = s.sample(logits_row[None].repeat(n, 1), [f"r{i}" for i in range(n)], [params] * n)
    return [o.token_id for o in out]


def test_draws_follow_the_softmax_of_logits_over_temperature():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    for temp in (1.0, 0.5, 2.0):
        want = torch.softmax(logits / temp, -1)
        got = _freqs(_draw(logits, SamplingParams(temperature=temp)), 6)
        assert (got - want).abs().max() < 0.03, (temp, got, want)


def test_top_k_and_top_p_draw_from_the_renormalised_head():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -0.5, -1.0, -2.0])
    got = _freqs(_draw(logits, SamplingParams(temperature=1.0, top_k=3)), 7)
    want = torch.softmax(logits[:3], -1)
    assert got[3:].sum() == 0 and (got[:3] - want).abs().max() < 0.03
    probs = torch.softmax(logits, -1)  # top-p 0.6: keeps tokens until the one crossing 0.6
    keep = int(((probs.cumsum(-1) - probs) < 0.6).sum())
    got = _freqs(_draw(logits, SamplingParams(temperature=1.0, top_p=0.6)), 7)
    want = torch.softmax(logits[:keep], -1)
    assert got[keep:].sum() == 0 and (got[:keep] - want).abs().max() < 0.03


def test_min_p_drops_tokens_below_the_fraction_of_the_best():
    logits = torch.tensor([0.0, -0.1, -1.0, -3.0, -5.0])
    got = _freqs(_draw(logits, SamplingParams(temperature=1.0, min_p=0.3)), 5)
    kept = torch.exp(logits) >= 0.3  # probs / max prob = exp(logit - best)
    assert got[~kept].sum() == 0 and (got[kept] > 0).all()


def test_rows_with_different_params_share_one_call():
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(9))
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0, top_k=1, seed=4),
        SamplingParams(temperature=0.7, top_p=0.9, logprobs=2),
        SamplingParams(temperature=1.0, min_p=1.0),
    ]
    out = Sampler(3).sample(logits, list("abcd"), params)
    assert out[0].token_id == int(logits[0].argmax())
    assert out[1].token_id == int(logits[1].argmax())
    assert out[3].token_id == int(logits[3].argmax())
    assert len(out[2].top_logprobs) == 2
    assert abs(out[2].logprob - float(torch.log_softmax(logits[2], -1)[out[2].token_id])) < 1e-5


def test_seeded_stream_moves_on_per_token_and_restarts_for_a_new_request():
    logits = torch.zeros(1, 1000)
    p = SamplingParams(temperature=1.0, seed=11)
    s = Sampler()
    first = [s.sample(logits, ["r"], [p])[0].token_id for _ in range(6)]
    assert len(set(first)) > 1  # not the same draw every step
    s.forget("r")
    again = [s.sample(logits, ["r"], [p])[0].token_id for _ in range(6)]
    assert again == first
    other = [Sampler().sample(logits, ["q"], [SamplingParams(temperature=1.0, seed=12)])[0].token_id for _ in range(1)]
    assert other[0] != first[0] or first[1:] != again[:-1]


@pytest.mark.parametrize(
    "row,want",
    [([float("-inf")] * 5, None), ([0.0, float("inf"), 1.0, float("nan"), 2.0], 1), ([float("nan")] * 5, None)],
)
def test_non_finite_rows_take_the_argmax(row, want):
    """No draw from a row without finite logits or with +inf: its argmax (any valid id when
    every value is -inf or NaN), never an error."""
    out = Sampler().sample(torch.tensor([row]), ["a"], [SamplingParams(temperature=1.0, top_p=0.5)])
    assert out[0].token_id == want if want is not None else 0 <= out[0].token_id < 5


def test_largest_seed_and_huge_vocab_draw():
    logits = torch.randn(2, 129_280, generator=torch.Generator().manual_seed(1))
    out = Sampler().sample(
        logits, ["a", "b"], [SamplingParams(temperature=1.0, seed=2**63 - 1), SamplingParams(temperature=1.0, top_k=50)]
    )
    assert all(0 <= o.token_id < 129_280 for o in out)
