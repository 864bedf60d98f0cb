from __future__ import annotations

import numpy as np
import pytest

from flashpd.bench.laws import Z90, Z99, AgentShape, LogQuantiles, UniformRange


def test_log_quantiles_pass_through_their_knots():
    law = LogQuantiles(10.0, 50.0, 400.0)
    values = law.from_z(np.array([0.0, Z90, Z99]))
    assert values == pytest.approx([10.0, 50.0, 400.0])


def test_log_quantiles_sample_percentiles_match():
    law = LogQuantiles(10.0, 50.0, 400.0)
    draws = law.sample(np.random.default_rng(0), 200_000)
    assert np.percentile(draws, [50, 90, 99]) == pytest.approx([10.0, 50.0, 400.0], rel=0.03)


def test_log_quantiles_clip_to_bounds():
    draws = LogQuantiles(10.0, 50.0, lo=5.0, hi=20.0).sample(np.random.default_rng(0), 10_000)
    assert draws.min() >= 5.0 and draws.max() <= 20.0


def test_log_quantiles_reject_unordered_knots():
    with pytest.raises(ValueError):
        LogQuantiles(10.0, 5.0)
    with pytest.raises(ValueError):
        LogQuantiles(10.0, 50.0, 40.0)


def test_agent_shape_dict_round_trip():
    shape = AgentShape()
    assert AgentShape.from_dict(shape.to_dict()) == shape


def test_agent_shape_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown"):
        AgentShape.from_dict({"bogus": 1})


def test_agent_shape_rejects_compaction_past_the_context_cap():
    with pytest.raises(ValueError, match="context cap"):
        AgentShape(long_window_compact_tokens=UniformRange(600_000, 2_000_000))
