"""Agent request fields (tools, tool_choice, parallel_tool_calls, response_format, n): every
refusal names its field; the fields become the prompt and the grammar the decode worker
enforces."""

from __future__ import annotations

import json

import pytest
from router_fakes import SERVED, ByteTokenizer

from flashpd.services.api import InvalidArgument
from flashpd.services.router import dsml
from flashpd.services.router.agent_fields import agent_options
from flashpd.services.router.convert import ModelTable, deepseek_chat_prompt
from flashpd.services.router.openai_compat import chat_request, completion_request

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
MSG = [{"role": "user", "content": "hi"}]


def _chat(**body):
    return chat_request({"messages": MSG, **body}, {}, ModelTable([SERVED]), ByteTokenizer())


@pytest.mark.parametrize(
    "body, field",
    [
        ({"tools": {"a": 1}}, "tools"),
        ({"tools": [{"type": "web"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": "yes"},
                }
            },
            "response_format.json_schema.strict",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"n": 2.5}, "n"),
        ({"n": -1}, "n"),
        ({"n": 10**30}, "n"),
        ({"n": "2"}, "n"),
        ({"n": True}, "n"),
    ],
)
def test_bad_agent_fields_name_the_field(body, field):
    with pytest.raises(InvalidArgument) as err:
        _chat(**body)
    assert err.value.field == field and err.value.http_status == 400


def test_completions_take_n_but_refuse_tools():
    models, tok = ModelTable([SERVED]), ByteTokenizer()
    assert completion_request({"prompt": "x", "n": 3}, {}, models, tok).agent.n == 3
    with pytest.raises(InvalidArgument) as err:
        completion_request({"prompt": "x", "tools": [WEATHER]}, {}, models, tok)
    assert err.value.field == "tools"


def test_required_and_named_choices_become_a_structural_tag_grammar():
    opts = agent_options({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}, chat=True)
    tag = json.loads(opts.guided.spec)
    assert opts.guided.kind == "structural_tag" and opts.guided.field == "tools"
    calls = tag["format"]["elements"][1]
    assert (calls["min"], calls["max"]) == (1, 1)  # parallel_tool_calls false: one call
    assert calls["content"]["elements"][0]["begin"] == '<｜DSML｜ invoke name="get_weather">\n'
    named = agent_options(
        {
            "tools": [WEATHER, {**WEATHER, "function": {"name": "other"}}],
            "tool_choice": {"type": "function", "function": {"name": "other"}},
        },
        chat=True,
    )
    named_calls = json.loads(named.guided.spec)["format"]["elements"][1]
    assert [t["begin"] for t in named_calls["content"]["elements"]] == ['<｜DSML｜ invoke name="other">\n']
    assert named_calls["max"] == dsml.MAX_FORCED_CALLS
    assert agent_options({"tools": [WEATHER]}, chat=True).guided is None  # auto: free


def test_response_format_reaches_the_sampling_params():
    req = _chat(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "p", "strict": True, "schema": {"type": "object"}},
        }
    ).request
    g = req.sampling.guided
    assert (g.kind, json.loads(g.spec), g.strict) == ("json_schema", {"type": "object"}, True)
    assert g.field == "response_format.json_schema.schema"
    assert _chat(response_format={"type": "json_object"}).request.sampling.guided.kind == "json_object"


def test_template_renders_tools_calls_and_results_in_v41_format():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome", "n": 2}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "tool", "tool_call_id": "c1", "content": "sun"},
    ]
    tools = (dsml.Tool("get_weather", "w", WEATHER["function"]["parameters"]),)
    text = deepseek_chat_prompt(messages, tools)
    assert text.startswith("<|begin_of_sentence|>Be brief.\n\n## Tools\n")
    assert (
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" '
        'string="true">Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n' in text
    )
    assert '<｜DSML｜ parameter name="n" string="false">2</｜DSML｜ parameter>' in text
    # the calls end the assistant turn; results in call order, one user turn, then generation
    assert text.endswith(
        "</｜DSML｜ invoke>\n</｜DSML｜ calls><|end_of_sentence|><|User|>"
        "<tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result>"
        "<|Assistant|>"
    )
    assert "Weather?<|Assistant|>\n\n<｜DSML｜ calls>\n" in text


def test_next_turn_prompt_extends_the_previous_prompt_and_output():
    """The multi-turn prefix property prefix caching needs: turn 2's prompt starts with turn 1's
    prompt followed by the text the model generated (its calls block)."""
    tools = (dsml.Tool("get_weather", "", WEATHER["function"]["parameters"]),)
    turn1 = deepseek_chat_prompt(MSG, tools)
    generated = dsml.CALLS_PREFIX + dsml.render_calls([("get_weather", {"city": "Oslo"})])
    _, calls = dsml.parse(generated)
    turn2 = deepseek_chat_prompt(
        MSG
        + [
            {"role": "assistant", "content": None, "tool_calls": [c.as_openai() for c in calls]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": "cold"},
        ],
        tools,
    )
    assert turn2.startswith(turn1 + generated + "<|end_of_sentence|>")


@pytest.mark.parametrize(
    "message, field",
    [
        ({"role": "tool", "content": "x"}, "messages[1].tool_call_id"),
        ({"role": "assistant", "tool_calls": "x"}, "messages[1].tool_calls"),
        (
            {
                "role": "assistant",
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{not json"}}],
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        ({"role": "user", "content": "x", "tool_calls": []}, "messages[1].tool_calls"),
    ],
)
def test_bad_agent_turns_name_the_field(message, field):
    with pytest.raises(InvalidArgument) as err:
        chat_request({"messages": MSG + [message], "tools": [WEATHER]}, {}, ModelTable([SERVED]), ByteTokenizer())
    assert err.value.field == field


def test_a_schema_beyond_the_grammar_size_limit_is_a_400():
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200} for i in range(6000)}}
    with pytest.raises(InvalidArgument) as err:
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": big}})
    assert err.value.field == "response_format.json_schema.schema"
