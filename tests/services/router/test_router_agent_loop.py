"""The bench's agent loop (bench/agent_loop.py) against the HTTP frontend with fake workers:
each turn's tool calls go to the fake tool and come back as tool messages in the next prompt."""

from __future__ import annotations

import asyncio

import pytest
import router_fakes
from router_fakes import EOS_ID, FakeDecode, FakePrefill, http_stack, text_ids

from flashpd.bench.agent_loop import run_loop
from flashpd.services.router import dsml
from flashpd.services.router.convert import ServedModel

pytestmark = pytest.mark.net
OUTPUT = text_ids(
    dsml.CALLS_PREFIX
    + dsml.render_calls([("get_weather", {"city": "Oslo", "days": 2}), ("search_files", {"query": "a", "limit": 1})])
) + (EOS_ID,)


def test_agent_loop_runs_the_fake_tool_between_turns(redis_url, monkeypatch):
    decode = router_fakes.ByteTokenizer.decode
    monkeypatch.setattr(
        router_fakes.ByteTokenizer, "decode", lambda self, ids: decode(self, [t for t in ids if t != EOS_ID])
    )
    # the tools' description alone is ~1,500 byte-tokens: a longer context than the default fake
    monkeypatch.setattr(router_fakes, "SERVED", ServedModel(router_fakes.MODEL, 16384, 256))
    d = FakeDecode("d0", output=OUTPUT)

    async def main():
        async with http_stack(redis_url, [FakePrefill("p0")], [d]) as (_, url):
            return await run_loop(url, "flash-tiny", sessions=1, turns=2, max_tokens=600, seed=0)

    result = asyncio.run(asyncio.wait_for(main(), 180))
    assert not result.errors
    assert [(r.turn, r.calls, r.valid_calls, r.finish_reason) for r in result.turns] == [
        (0, 2, 2, "tool_calls"),
        (1, 2, 2, "tool_calls"),
    ]
    second = bytes(d.seen[1].prompt_ids).decode()
    assert '<tool_result>{"city": "Oslo", "forecast": [' in second
    assert '<tool_result>{"matches": ["src/a_0.py"]}</tool_result><|Assistant|>' in second
    assert d.seen[0].sampling.guided.kind == "structural_tag"  # required on turn 0
    assert d.seen[1].sampling.guided is None  # auto on the last turn
    assert d.seen[1].session_id == d.seen[0].session_id == "agent-0-0"
