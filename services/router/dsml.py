"""DeepSeek V4.1's tool-call markup (DSML): rendering tools and calls into the prompt, parsing
the model's calls back (whole or streamed), and the grammar that enforces a call.

The format (DeepSeek-V4.1 release, `encoding/encoding.py`; the same tag names as SGLang's
`DeepSeekV41Detector` and xgrammar's `deepseek_v4_1` structural tag; see docs/agent_api.md):

    <｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

- the DSML marker is `｜DSML｜` (fullwidth vertical bars, U+FF5C); V4.1's tag names carry a
  leading space (`" calls"`, `" invoke"`, `" parameter"`), unlike V3.2/V4 (`<｜DSML｜invoke`,
  `<｜DSML｜tool_calls>`, `<｜DSML｜function_calls>`);
- string arguments are raw text with `string="true"`; every other value is JSON, `string="false"`;
- an assistant turn is `content` + "\\n\\n" + the calls block + EOS (the block is rendered even
  when the content is empty); consecutive invokes are joined by "\\n";
- tool results come back inside the next user turn, one `<tool_result>...</tool_result>` per
  call in call order, joined by "\\n\\n";
- the tools are described in the system prompt by `TOOLS_TEMPLATE` with one JSON schema per
  line.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

DSML = "｜DSML｜"
CALLS, INVOKE, PARAMETER = " calls", " invoke", " parameter"
CALLS_OPEN, CALLS_CLOSE = f"<{DSML}{CALLS}>", f"</{DSML}{CALLS}>"
INVOKE_CLOSE = f"</{DSML}{INVOKE}>"
CALLS_PREFIX = "\n\n"  # between an assistant turn's content and its calls block
RESPONSE_FORMAT_TEMPLATE = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"
TOOL_RESULT_TEMPLATE = "<tool_result>{content}</tool_result>"
# Enforced calls: whitespace between parameters is bounded (a weak model would pad forever), and
# a tool declared without a schema takes no arguments.
MAX_WHITESPACE = 1
MAX_FORCED_CALLS = 8  # calls in one forced turn (a weak model could chain invokes forever)
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}

TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by \
writing a "<{dsml}{calls}>" block like the following:

<{dsml}{calls}>
<{dsml}{invoke} name="$TOOL_NAME">
<{dsml}{parameter} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}{parameter}>
...
</{dsml}{invoke}>
<{dsml}{invoke} name="$TOOL_NAME2">
...
</{dsml}{invoke}>
</{dsml}{calls}>

String parameters should be specified as is and set `string="true"`. For all other types \
(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

_INVOKE_RE = re.compile(
    re.escape(f"<{DSML}{INVOKE}") + r' name="([^"]*)">\n?(.*?)' + re.escape(INVOKE_CLOSE), re.DOTALL
)
_PARAM_RE = re.compile(
    re.escape(f"<{DSML}{PARAMETER}") + r' name="([^"]*)" string="(true|false)">'
    r"(.*?)" + re.escape(f"</{DSML}{PARAMETER}>"),
    re.DOTALL,
)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict | None = None  # JSON schema of the arguments object
    strict: bool = False

    def schema_line(self) -> str:
        fn: dict = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters if self.parameters is not None else {"type": "object", "properties": {}}
        return _json(fn)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object as text (OpenAI's shape)

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# ------------------------------------------------------------------------------------ rendering


def render_tools(tools: Sequence[Tool]) -> str:
    return TOOLS_TEMPLATE.format(
        dsml=DSML, calls=CALLS, invoke=INVOKE, parameter=PARAMETER, schemas="\n".join(t.schema_line() for t in tools)
    )


def render_calls(calls: Sequence[tuple[str, dict]]) -> str:
    """(name, arguments object) pairs as the calls block an assistant turn ends with."""
    invokes = []
    for name, arguments in calls:
        params = "\n".join(
            f'<{DSML}{PARAMETER} name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
            f"{value if isinstance(value, str) else _json(value)}</{DSML}{PARAMETER}>"
            for key, value in arguments.items()
        )
        invokes.append(f'<{DSML}{INVOKE} name="{name}">\n{params}\n{INVOKE_CLOSE}')
    return f"{CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{CALLS_CLOSE}"


def render_tool_results(contents: Sequence[str]) -> str:
    return "\n\n".join(TOOL_RESULT_TEMPLATE.format(content=c) for c in contents)


# -------------------------------------------------------------------------------------- parsing


def parse(text: str) -> tuple[str, list[ToolCall] | None]:
    """(content, calls) from a finished assistant turn. Text without a calls block, or with a
    malformed one (unclosed, a parameter that is not JSON where it must be, no invoke), is all
    content and calls is None: malformed output reaches the client as text, never an error."""
    start = text.find(CALLS_OPEN)
    if start < 0:
        return text, None
    end = text.find(CALLS_CLOSE, start)
    if end < 0 or text[end + len(CALLS_CLOSE) :].strip():
        return text, None
    calls = parse_invokes(text[start + len(CALLS_OPEN) : end])
    if not calls:
        return text, None
    content = text[:start]
    return (content[: -len(CALLS_PREFIX)] if content.endswith(CALLS_PREFIX) else content), calls


def parse_invokes(block: str) -> list[ToolCall] | None:
    """The invokes of a calls block's body; None when any part of it is malformed."""
    calls, pos = [], 0
    for m in _INVOKE_RE.finditer(block):
        if block[pos : m.start()].strip():
            return None
        arguments = _parse_parameters(m.group(2))
        if arguments is None or not m.group(1):
            return None
        calls.append(ToolCall(new_call_id(), m.group(1), _json(arguments)))
        pos = m.end()
    return calls if calls and not block[pos:].strip() else None


def _parse_parameters(body: str) -> dict | None:
    arguments, pos = {}, 0
    for m in _PARAM_RE.finditer(body):
        if body[pos : m.start()].strip():
            return None
        name, is_string, value = m.groups()
        if is_string == "true":
            arguments[name] = value
        else:
            try:
                arguments[name] = json.loads(value)
            except ValueError:
                return None
        pos = m.end()
    return arguments if not body[pos:].strip() else None


class StreamParser:
    """Incremental `parse` for SSE: `push(text)` -> (content delta, calls); `finish()` ->
    (content still held, calls). Content is released as soon as it cannot be the start of a
    calls block; the calls are released at the end of the stream (only then is the block known
    to be well formed: text after it would make it all content, as `parse` decides), so the
    streamed content and calls always equal `parse` of the whole text."""

    def __init__(self) -> None:
        self._held = ""  # text that may begin a calls block, or the block so far

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        buf = self._held + text
        start = buf.find(CALLS_OPEN)
        if start >= 0:  # in a block: hold it (and the prefix before it) until the end
            cut = start - len(CALLS_PREFIX) if buf[:start].endswith(CALLS_PREFIX) else start
            self._held = buf[cut:]
            return buf[:cut], []
        keep = _partial_suffix(buf, CALLS_PREFIX + CALLS_OPEN)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], []

    def finish(self) -> tuple[str, list[ToolCall]]:
        held, self._held = self._held, ""
        content, calls = parse(held)
        return (content, calls) if calls else (held, [])


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`... or the
    marker's CALLS_OPEN part (content may end in a lone "\\n")."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]) or CALLS_OPEN.startswith(text[-n:]):
            return n
    return 0


# -------------------------------------------------------------------------------------- grammar


def structural_tag(tools: Sequence[Tool], *, parallel: bool) -> str:
    """xgrammar structural tag (JSON text) that forces a calls block: 1..MAX_FORCED_CALLS
    invokes of `tools` (exactly one when `parallel` is False), each with arguments that follow
    the tool's parameter schema in V4.1's parameter style. The block ends the turn (EOS
    follows)."""
    tags = [_invoke_tag(t) for t in tools]
    # invokes end in "\n", so they follow each other with no separator (the template's join)
    calls = {
        "type": "repeat",
        "min": 1,
        "max": MAX_FORCED_CALLS if parallel else 1,
        "content": {"type": "or", "elements": tags},
    }
    return _json(
        {
            "type": "structural_tag",
            "format": {
                "type": "sequence",
                "elements": [
                    {"type": "const_string", "value": f"{CALLS_PREFIX}{CALLS_OPEN}\n"},
                    calls,
                    {"type": "const_string", "value": CALLS_CLOSE},
                ],
            },
        }
    )


def _invoke_tag(t: Tool) -> dict:
    """One invoke of tool `t`: its arguments follow the parameter schema, in V4.1's style."""
    return {
        "type": "tag",
        "begin": f'<{DSML}{INVOKE} name="{t.name}">\n',
        "content": {
            "type": "json_schema",
            "style": "deepseek_v4_1_xml",
            "json_schema": t.parameters if t.parameters is not None else NO_ARGUMENTS,
            "max_whitespace_cnt": MAX_WHITESPACE,
        },
        "end": f"{INVOKE_CLOSE}\n",
    }
