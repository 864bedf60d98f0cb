"""DSML tool-call markup: render -> parse round trip, malformed text stays content, and the
streaming parser agrees with the whole-text parser whatever the chunking."""

from __future__ import annotations

import json

import pytest

from flashpd.services.router import dsml

CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("search", {"q": "a<b", "tags": ["x"]})]
TEXT = "Let me check." + dsml.CALLS_PREFIX + dsml.render_calls(CALLS)


def test_render_then_parse_round_trips():
    content, calls = dsml.parse(TEXT)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    assert all(c.id.startswith("call_") for c in calls) and len({c.id for c in calls}) == 2


@pytest.mark.parametrize(
    "text",
    [
        "plain text",
        TEXT[:-5],  # unclosed block
        TEXT.replace('string="false">3', 'string="false">{3'),  # a non-JSON value
        TEXT + " trailing",
        dsml.CALLS_OPEN + "\n" + dsml.CALLS_CLOSE,  # no invoke
    ],
)
def test_malformed_markup_is_content(text):
    assert dsml.parse(text) == (text, None)


@pytest.mark.parametrize("step", [1, 2, 7, 64])
@pytest.mark.parametrize("text", [TEXT, TEXT[:-5], "no calls\n\n", "a\n\n<｜DSML｜ cal"])
def test_stream_parser_matches_the_whole_parse(text, step):
    parser, content, calls = dsml.StreamParser(), "", []
    for i in range(0, len(text), step):
        c, new = parser.push(text[i : i + step])
        content, calls = content + c, calls + new
    c, new = parser.finish()
    content, calls = content + c, calls + new
    whole_content, whole_calls = dsml.parse(text)
    assert content == whole_content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls or []]
