"""The OpenAI request fields agents send: `tools`, `tool_choice`, `parallel_tool_calls`,
`response_format` and `n`, validated into one `AgentOptions` (each refusal names the field).

    tool_choice        what the model may do                  how it is enforced
    none               answer in text: the tools are not       nothing to parse (markup the
                       described in the prompt                 model writes stays content)
    auto (default)     text, or calls in DSML markup           no grammar; parsed after the fact
    required           one or more calls of any tool           grammar: a DSML calls block
    {"type": "function", "function": {"name": X}}  calls of X  grammar: a block of X calls
    parallel_tool_calls false: at most one call (enforced under required/named; under auto only
    the first parsed call is returned).

    response_format    json_object: any JSON object; json_schema: the schema (`strict` maps to
                       the grammar's strict mode: no properties or items beyond the declared)

Both are enforced with the grammar mask where tokens are sampled (`engine/grammar.py`), so even
a model that would never call a tool on its own does when required to; they cannot be combined
(a forced call is not a JSON reply). `n` choices: 1..MAX_N, streaming or not (`choices.py`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flashpd.engine.sampling_params import GuidedDecoding, SamplingError
from flashpd.services.api import InvalidArgument
from flashpd.services.router import dsml
from flashpd.services.router import validation as v

# JSON Schema keywords the grammar engine (xgrammar 0.2.8) compiles but does not enforce, or
# enforces wrongly (measured: a grammar from each accepts an instance that violates it, or
# refuses one that satisfies it). A schema that the grammar enforces must not hold them: the
# output would not validate (refused, naming the field and the keyword's path). `format` is an
# annotation in Draft 2020-12 (validators ignore unknown formats), so it is left alone; `oneOf`
# is enforced as `anyOf` (alternatives that overlap are not excluded).
UNENFORCED_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "dependentRequired",
        "dependentSchemas",
        "patternProperties",
        "propertyNames",
        "minProperties",
        "maxProperties",
        "unevaluatedItems",
    }
)
# where subschemas live: keyword -> how its value holds them
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "unevaluatedProperties")
MAX_TOOLS = 128
MAX_N = 16
MAX_DESCRIPTION_CHARS = 8192
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function and schema names
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class AgentOptions:
    tools: tuple[dsml.Tool, ...] = ()
    tool_choice: str = "none"  # none | auto | required | named
    named_tool: str | None = None
    parallel_tool_calls: bool = True
    response_schema: dict | None = None  # described in the prompt (json_schema)
    guided: GuidedDecoding | None = None
    n: int = 1

    @property
    def parses_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def prompt_tools(self) -> tuple[dsml.Tool, ...]:
        """The tools the prompt describes: none under tool_choice none (the model is offered
        no call; V4.1's template has no "described but not callable" mode)."""
        return self.tools if self.tool_choice != "none" else ()


def agent_options(body: Mapping, *, chat: bool) -> AgentOptions:
    n = v.as_int(body["n"], "n", 1, MAX_N) if body.get("n") is not None else 1
    if not chat:
        return AgentOptions(n=n)
    tools = _tools(body.get("tools"))
    choice, named = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else v.as_bool(parallel, "parallel_tool_calls")
    kind, schema, strict = _response_format(body.get("response_format"))
    try:
        guided = _guided(tools, choice, named, parallel, kind, schema, strict)
    except SamplingError as exc:  # e.g. a schema beyond MAX_GUIDED_SPEC_CHARS
        raise InvalidArgument(exc.message, field=exc.field) from None
    return AgentOptions(tools, choice, named, parallel, schema, guided, n)


def _guided(
    tools: tuple[dsml.Tool, ...],
    choice: str,
    named: str | None,
    parallel: bool,
    kind: str,
    schema: dict | None,
    strict: bool,
) -> GuidedDecoding | None:
    guided = None
    if choice in ("required", "named"):
        if kind != "text":
            raise InvalidArgument(f"cannot be {kind} while tool_choice forces a tool call", field="response_format")
        called = [t for t in tools if named is None or t.name == named]
        for t in called:  # the grammar enforces these tools' argument schemas
            check_enforceable(t.parameters, f"tools[{tools.index(t)}].function.parameters")
        guided = GuidedDecoding("structural_tag", dsml.structural_tag(called, parallel=parallel), field="tools")
    elif kind == "json_object":
        guided = GuidedDecoding("json_object")
    elif kind == "json_schema":
        guided = GuidedDecoding(
            "json_schema", json.dumps(schema), strict=strict, field="response_format.json_schema.schema"
        )
    return guided


def _tools(value: Any) -> tuple[dsml.Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidArgument("must be a list of tools", field="tools")
    if len(value) > MAX_TOOLS:
        raise InvalidArgument(f"must hold at most {MAX_TOOLS} tools, got {len(value)}", field="tools")
    tools = [_tool(item, f"tools[{i}]") for i, item in enumerate(value)]
    names = [t.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidArgument(f"duplicate tool name {name!r}", field=f"tools[{i}].function.name")
    return tuple(tools)


def _tool(item: Any, field: str) -> dsml.Tool:
    if not isinstance(item, dict):
        raise InvalidArgument("must be an object", field=field)
    if item.get("type") != "function":
        raise InvalidArgument(f'must be "function", got {v.show(item.get("type"))}', field=f"{field}.type")
    fn = item.get("function")
    if not isinstance(fn, dict):
        raise InvalidArgument("must be an object with a name", field=f"{field}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise InvalidArgument(
            f"must be 1-64 letters, digits, underscores or dashes, got {v.show(name)}", field=f"{field}.function.name"
        )
    description = fn.get("description") or ""
    v.as_text(description, f"{field}.function.description", max_chars=MAX_DESCRIPTION_CHARS)
    parameters = fn.get("parameters")
    if parameters is not None:
        _check_schema(parameters, f"{field}.function.parameters")
    strict = fn.get("strict")
    strict = False if strict is None else v.as_bool(strict, f"{field}.function.strict")
    return dsml.Tool(name, description, parameters, strict)


def _tool_choice(value: Any, tools: tuple[dsml.Tool, ...]) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if tools else "none"), None
    if isinstance(value, str):
        if value not in CHOICES:
            raise InvalidArgument(
                f"must be one of {list(CHOICES)} or a named function, got {v.show(value)}", field="tool_choice"
            )
        if value == "required" and not tools:
            raise InvalidArgument("required needs tools", field="tool_choice")
        return value, None
    fn = value.get("function") if isinstance(value, dict) else None
    if not isinstance(fn, dict) or value.get("type") != "function":
        raise InvalidArgument(
            'must be a string or {"type": "function", "function": {"name": ...}}', field="tool_choice"
        )
    name = fn.get("name")
    if name not in {t.name for t in tools}:
        raise InvalidArgument(f"names no tool in tools: {v.show(name)}", field="tool_choice.function.name")
    return "named", name


def _response_format(value: Any) -> tuple[str, dict | None, bool]:
    """(kind, schema, strict)."""
    if value is None:
        return "text", None, False
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("text", "json_object"):
        return kind, None, False
    if kind != "json_schema":
        raise InvalidArgument(
            'must be {"type": "text" | "json_object" | "json_schema", ...}',
            field="response_format.type" if isinstance(value, dict) else "response_format",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidArgument("must be an object with name and schema", field="response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise InvalidArgument(
            "must be 1-64 letters, digits, underscores or dashes", field="response_format.json_schema.name"
        )
    schema = spec.get("schema", {"type": "object"})
    _check_schema(schema, "response_format.json_schema.schema")
    check_enforceable(schema, "response_format.json_schema.schema")
    strict = spec.get("strict")
    strict = False if strict is None else v.as_bool(strict, "response_format.json_schema.strict")
    return kind, schema, strict


def _check_schema(schema: Any, field: str) -> None:
    """A JSON schema object that is a valid Draft 2020-12 schema (the grammar engine refuses
    what it cannot compile later, on the decode worker, with the same field)."""
    if not isinstance(schema, dict):
        raise InvalidArgument(f"must be a JSON schema object, got {v.show(schema)}", field=field)
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "the top level"
        raise InvalidArgument(f"is not a valid JSON schema at {where}: {exc.message[:200]}", field=field) from None


def check_enforceable(schema: dict | None, field: str) -> None:
    """Refuse a (valid) schema that uses a keyword the grammar cannot enforce
    (`UNENFORCED_KEYWORDS`), naming the field and where the keyword is."""
    stack: list[tuple[object, str]] = [(schema, "")]
    while stack:  # iterative: a deep schema cannot exhaust the recursion limit
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        bad = sorted(UNENFORCED_KEYWORDS.intersection(node))
        if bad:
            where = path.lstrip("/") or "the top level"
            raise InvalidArgument(
                f"uses {bad[0]!r} at {where}, which the grammar engine "
                "cannot enforce (unsupported keywords: "
                f"{sorted(UNENFORCED_KEYWORDS)})",
                field=field,
            )
        stack.extend(_subschemas(node, path))


def _subschemas(node: dict, path: str) -> list[tuple[object, str]]:
    out: list[tuple[object, str]] = []
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out += [(sub, f"{path}/{key}/{name}") for name, sub in node[key].items()]
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            out += [(sub, f"{path}/{key}/{i}") for i, sub in enumerate(node[key])]
    for key in _SUBSCHEMA_ONE:
        if isinstance(node.get(key), dict):
            out.append((node[key], f"{path}/{key}"))
    return out
