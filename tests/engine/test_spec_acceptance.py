"""Acceptance rules of engine/speculative.py.

Rejection sampling is checked statistically on a 5-token vocabulary: the target is a Markov chain
p(next | prev) and the drafter another chain q; tokens are produced by verify steps only (each
step drafts k tokens from q, verifies them against p with `accept_sampled`, continues from its
last token), both filtered with the same temperature / top-k. The first three tokens must follow
p's chain: chi-square over the 125 joint outcomes, fixed seeds (no wall clock, no flake). A
verifier that accepts every draft fails the same test (the test can fail).
"""

from __future__ import annotations

import math

import pytest
import torch

from flashpd.engine.sampling import SamplingParams, filtered_probs
from flashpd.engine.speculative import ForcedSchedule, Verdict, accept_greedy, accept_sampled, ngram_lookup

V, K, N_SAMPLES = 5, 3, 4000


def _chains(params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    p_logits = torch.randn(V, V, generator=g) * 1.5
    q_logits = torch.randn(V, V, generator=g) * 1.5
    return (filtered_probs(p_logits, [params] * V), filtered_probs(q_logits, [params] * V))


def _generate(p, q, gen, verify) -> tuple[int, int, int]:
    out, prev = [], 0
    while len(out) < 3:
        drafts, probs, x = [], [], prev
        for _ in range(K):
            x = int(torch.multinomial(q[x], 1, generator=gen))
            probs.append(q[drafts[-1] if drafts else prev])
            drafts.append(x)
        rows = torch.stack([p[prev]] + [p[d] for d in drafts])  # p after anchor, each draft
        verdict = verify(rows, torch.stack(probs), drafts, gen)
        out += list(verdict.tokens)
        prev = out[-1]
    return tuple(out[:3])


def _chi2_pvalue(stat: float, dof: int) -> float:
    """Wilson-Hilferty: the upper tail of chi-square(dof) at stat."""
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _test_against_chain(params: SamplingParams, verify) -> float:
    p, q = _chains(params)
    gen = torch.Generator().manual_seed(11)
    counts: dict[tuple[int, int, int], int] = {}
    for _ in range(N_SAMPLES):
        key = _generate(p, q, gen, verify)
        counts[key] = counts.get(key, 0) + 1
    stat, cells = 0.0, 0
    for a in range(V):
        for b in range(V):
            for c in range(V):
                expected = N_SAMPLES * float(p[0, a] * p[a, b] * p[b, c])
                observed = counts.get((a, b, c), 0)
                if expected == 0:
                    assert observed == 0, f"{(a, b, c)} has probability 0 under the target"
                    continue
                stat += (observed - expected) ** 2 / expected
                cells += 1
    return _chi2_pvalue(stat, cells - 1)


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3, top_p=0.9)]
)
def test_rejection_sampling_preserves_the_target_distribution(params):
    assert _test_against_chain(params, accept_sampled) > 1e-3


def test_the_statistical_test_catches_a_biased_verifier():
    def accept_all(rows, probs, drafts, gen):
        return Verdict(tuple(drafts) + (int(torch.multinomial(rows[-1], 1, generator=gen)),), len(drafts))

    assert _test_against_chain(SamplingParams(temperature=1.0), accept_all) < 1e-6


def test_point_mass_drafts_reject_to_the_rest_of_p():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    gen = torch.Generator().manual_seed(0)
    firsts = [accept_sampled(p, None, [0], gen).tokens[0] for _ in range(4000)]
    share = firsts.count(0) / len(firsts)
    assert abs(share - 0.5) < 0.05  # accepted with p(0) = 0.5; else drawn from {1: .6, 2: .4}
    assert 3 not in firsts


def test_greedy_acceptance():
    assert accept_greedy([4, 5, 6, 7], [4, 5, 6]) == Verdict((4, 5, 6, 7), 3)
    assert accept_greedy([4, 5, 6, 7], [4, 9, 6]) == Verdict((4, 5), 1)
    assert accept_greedy([4], []) == Verdict((4,), 0)
    assert accept_greedy([1, 5], [4]) == Verdict((1,), 0)


def test_forced_schedule_hits_the_mean():
    sched = ForcedSchedule(3.5)
    got = [sched.next("r", 5) for _ in range(10)]
    assert got == [2, 3] * 5
    sched = ForcedSchedule(3.51)
    got = [sched.next("r", 5) for _ in range(100)]
    assert sum(got) == 251 and set(got) <= {2, 3}
    assert ForcedSchedule(6.0).next("x", 4) == 4  # never more than drafted


def test_ngram_lookup_prefers_longest_latest_match():
    seq = [1, 2, 3, 9, 2, 3, 8, 1, 2, 3]
    assert ngram_lookup(seq, 2, 1, 3) == [9, 2]  # "1 2 3" at 0 beats "2 3" at 4
    assert ngram_lookup([1, 2, 7, 2], 3, 1, 3) == [7, 2]
    assert ngram_lookup([1, 2, 3], 3, 1, 3) == []


def _ngram_loop(seq, k, n_min, n_max):
    """The prompt lookup as a plain loop (the reference for the vectorised one)."""
    size = len(seq)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        tail = list(seq[size - n :])
        for start in range(size - n - 1, -1, -1):
            if list(seq[start : start + n]) == tail:
                return list(seq[start + n : start + n + k])
    return []


def test_vectorised_ngram_lookup_equals_the_loop_and_the_cached_prefix_follows_growth():
    import random

    from flashpd.engine.speculative import NgramDrafter

    rng = random.Random(0)
    for trial in range(300):
        size = rng.randint(1, 60)
        seq = [rng.randint(0, 3 + trial % 6) for _ in range(size)]
        for n_min, n_max in ((1, 4), (2, 3), (1, 1)):
            assert ngram_lookup(seq, 5, n_min, n_max) == _ngram_loop(seq, 5, n_min, n_max)
    drafter = NgramDrafter(3)
    tokens = [1, 2, 3, 4, 1, 2]
    st = drafter.new_state(tokens)
    assert drafter.propose([st], [3], [6], None).tokens == [[4, 1, 2]]
    tokens += [3, 9, 1, 2, 3]  # the request's list grows; the cache copies only the new ids
    assert drafter.propose([st], [9], [11], None).tokens == [[1, 2, 3]]
    assert st.ids.tolist()[:11] == tokens[:11]
