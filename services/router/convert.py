"""Edge conversion: the one place where wire types (proto/flashpd.proto) meet the internal API,
plus the chat template and the checks on prompts and context shared by the gRPC and HTTP
frontends (field limits live in `validation.py`).

Validation errors are `InvalidArgument` with `field` set to the request field at fault.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from flashpd.services.api import (
    FinalEvent,
    InternalRequest,
    InvalidArgument,
    SamplingParams,
    Timeline,
    TokenEvent,
    TokenLogprobs,
    Usage,
)
from flashpd.services.router import dsml
from flashpd.services.router import validation as v
from flashpd.services.router.agent_fields import MAX_N, AgentOptions, agent_options
from flashpd.services.router.text import Tokenizer
from flashpd_sdk._gen import flashpd_pb2 as pb

DEFAULT_MAX_TOKENS = 16
MAX_ID_CHARS = v.MAX_ID_CHARS  # request and session ids

# DeepSeek-style chat markers, as plain strings (the tokenizer maps them to special tokens).
BOS = "<|begin_of_sentence|>"
EOS = "<|end_of_sentence|>"
USER = "<|User|>"
ASSISTANT = "<|Assistant|>"
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: OpenAI's new system
MAX_TOOL_CALLS = 128  # per assistant message

FINISH_TO_PROTO = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}
FINISH_FROM_PROTO = {v: k for k, v in FINISH_TO_PROTO.items()}
FINISH_FROM_PROTO[pb.FINISH_REASON_TOOL_CALLS] = "stop"  # the internal API has no tool_calls


# ------------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ServedModel:
    name: str
    context_tokens: int  # prompt + completion limit
    vocab_size: int


class ModelTable:
    def __init__(self, models: Sequence[ServedModel]) -> None:
        if not models:
            raise ValueError("at least one served model is required")
        self.models = tuple(models)
        self._by_name = {m.name: m for m in models}

    @property
    def default(self) -> ServedModel:
        return self.models[0]

    def resolve(self, name: str) -> ServedModel:
        """Empty name -> the default (first) model."""
        if not name:
            return self.default
        if name not in self._by_name:
            raise v.ModelNotFound(
                f"the model {v.show(name)} does not exist; served: {sorted(self._by_name)}", field="model"
            )
        return self._by_name[name]


# ------------------------------------------------------------------------------- chat template


def deepseek_chat_prompt(
    messages: Sequence[dict], tools: Sequence[dsml.Tool] = (), response_format: dict | None = None
) -> str:
    """DeepSeek-style prompt: BOS, system text, then `<|User|>u<|Assistant|>a<|end_of_sentence|>`
    per turn, ending with `<|Assistant|>` so the model writes the next assistant turn.

    Agent turns follow DeepSeek V4.1's format (`dsml.py`, docs/agent_api.md): the tools and a
    response-format schema are described at the end of the system text; an assistant turn with
    `tool_calls` ends with its DSML calls block; `tool` messages become one user turn of
    `<tool_result>` blocks in the order of the calls they answer (a user message right after
    them joins that turn)."""
    if not messages:
        raise InvalidArgument("must contain at least one message", field="messages")
    transcript = _Transcript()
    for i, message in enumerate(messages):
        transcript.add(message, i)
    transcript.close()
    return BOS + _system_text(transcript.system, tools, response_format) + "".join(transcript.turns) + ASSISTANT


class _Transcript:
    """The system texts and the prompt's turns, message by message. Tool messages gather into one
    pending user turn of tool results, closed by the next other message (a user message joins it)."""

    def __init__(self) -> None:
        self.system: list[str] = []
        self.turns: list[str] = []
        # tool_call_id -> position in the calls of the assistant message the tool messages answer
        # (None: no such message right before them)
        self._calls_order: dict[str, int] | None = None
        self._results: list[tuple[int, str]] = []  # the pending tool-results turn

    def add(self, message: dict, i: int) -> None:
        role, content = _message_parts(message, i)
        if role != "tool":
            self._calls_order = None
            if self._results:
                self._close_results(content if role == "user" else None)
                if role == "user":
                    return
        if role in ("system", "developer"):
            self.system.append(content)
        elif role == "user":
            self.turns.append(USER + content)
        elif role == "tool":
            position = _answered_call(message["tool_call_id"], self._calls_order, self._results, i)
            self._results.append((position, content))
        else:
            self._add_assistant(message, content, i)

    def close(self) -> None:
        if self._results:
            self._close_results(None)

    def _close_results(self, user_text: str | None) -> None:
        """The tool results in the order of the calls they answer, then `user_text` if any."""
        text = dsml.render_tool_results([c for _, c in sorted(self._results)])
        self.turns.append(USER + text + ("\n\n" + user_text if user_text is not None else ""))
        self._results = []

    def _add_assistant(self, message: dict, content: str, i: int) -> None:
        calls = _assistant_calls(message, i)
        self._calls_order = {call_id: n for n, (call_id, _, _) in enumerate(calls) if call_id}
        block = dsml.CALLS_PREFIX + dsml.render_calls([(n, a) for _, n, a in calls]) if calls else ""
        self.turns.append(ASSISTANT + content + block + EOS)


def _system_text(system: list[str], tools: Sequence[dsml.Tool], response_format: dict | None) -> str:
    """The system texts, then the tools and the response-format schema described (DSML)."""
    text = "\n\n".join(system)
    if tools:
        text += ("\n\n" if text else "") + dsml.render_tools(tools)
    if response_format is not None:
        text += ("\n\n" if text else "") + dsml.RESPONSE_FORMAT_TEMPLATE.format(
            schema=json.dumps(response_format, ensure_ascii=False)
        )
    return text


def _answered_call(call_id: str, calls_order: dict[str, int] | None, results: list[tuple[int, str]], i: int) -> int:
    """The position of the call a tool message answers, among the tool calls of the assistant
    message right before the tool messages (OpenAI's rule: a result answers a call made)."""
    field = f"messages[{i}].tool_call_id"
    if calls_order is None:
        raise InvalidArgument("a tool message must follow an assistant message with tool_calls", field=field)
    if call_id not in calls_order:
        raise InvalidArgument(
            f"{v.show(call_id)} is not the id of a tool call of the assistant "
            f"message before it ({len(calls_order)} calls)",
            field=field,
        )
    position = calls_order[call_id]
    if any(p == position for p, _ in results):
        raise InvalidArgument(f"the call {v.show(call_id)} is already answered", field=field)
    return position


def _message_parts(message: object, i: int) -> tuple[str, str]:
    if not isinstance(message, dict):
        raise InvalidArgument("must be an object with role and content", field=f"messages[{i}]")
    role = message.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise InvalidArgument(f"must be one of {list(CHAT_ROLES)}, got {v.show(role)}", field=f"messages[{i}].role")
    for unsupported in ("function_call", "audio"):
        if message.get(unsupported) is not None:
            raise InvalidArgument("is not supported by this server", field=f"messages[{i}].{unsupported}")
    if message.get("tool_calls") is not None and role != "assistant":
        raise InvalidArgument("is only allowed on assistant messages", field=f"messages[{i}].tool_calls")
    if role == "tool":
        v.as_text(message.get("tool_call_id"), f"messages[{i}].tool_call_id", max_chars=256, empty_ok=False)
    if message.get("name") is not None:
        v.as_text(message["name"], f"messages[{i}].name", max_chars=256)
    return role, _content_text(message, role, i)


def _content_text(message: dict, role: str, i: int) -> str:
    content = message.get("content")
    if content is None and role == "assistant" and message.get("tool_calls"):
        content = ""  # OpenAI: an assistant turn that only calls tools has null content
    if isinstance(content, list):  # OpenAI content parts: only text parts are supported
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise InvalidArgument("only text content parts are supported", field=f"messages[{i}].content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise InvalidArgument("must be a string or a list of text parts", field=f"messages[{i}].content")
    v.check_unicode(content, f"messages[{i}].content")
    return content


def _assistant_calls(message: dict, i: int) -> list[tuple[str, str, dict]]:
    """(id, name, arguments object) of an assistant message's `tool_calls`."""
    calls = message.get("tool_calls")
    if calls is None:
        return []
    field = f"messages[{i}].tool_calls"
    if not isinstance(calls, list) or len(calls) > MAX_TOOL_CALLS:
        raise InvalidArgument(f"must be a list of at most {MAX_TOOL_CALLS} tool calls", field=field)
    return [_tool_call(call, f"{field}[{j}]") for j, call in enumerate(calls)]


def _tool_call(call: object, f: str) -> tuple[str, str, dict]:
    """(id, name, arguments object) of one entry of `tool_calls`; `f` is its field name."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or call.get("type", "function") != "function":
        raise InvalidArgument('must be {"id", "type": "function", "function": {"name", "arguments"}}', field=f)
    call_id = v.as_text(call.get("id", ""), f"{f}.id", max_chars=256)
    name = v.as_text(fn.get("name"), f"{f}.function.name", max_chars=64, empty_ok=False)
    arguments = fn.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError:
            raise InvalidArgument("must be a JSON object as text", field=f"{f}.function.arguments") from None
    if not isinstance(arguments, dict):
        raise InvalidArgument("must be a JSON object", field=f"{f}.function.arguments")
    return call_id, name, arguments


# ---------------------------------------------------------------------------------- validation


def check_prompt_ids(ids: Sequence[int], model: ServedModel, field: str) -> tuple[int, ...]:
    return v.token_ids(list(ids), field, model.vocab_size)


def check_context(
    model: ServedModel, prompt_tokens: int, max_tokens: int, prompt_field: str, *, max_tokens_field: str = "max_tokens"
) -> None:
    if prompt_tokens > model.context_tokens:
        raise InvalidArgument(
            f"{prompt_tokens} tokens exceed the context limit of {model.context_tokens} tokens", field=prompt_field
        )
    if prompt_tokens + max_tokens > model.context_tokens:
        raise InvalidArgument(
            f"prompt ({prompt_tokens}) + {max_tokens_field} ({max_tokens}) exceeds the context "
            f"limit of {model.context_tokens} tokens",
            field=max_tokens_field,
        )


def check_id(value: str, field: str) -> str | None:
    """Request/session ids: printable ASCII without spaces, at most MAX_ID_CHARS."""
    return v.as_id(value, field)


def new_request_id() -> str:
    return uuid.uuid4().hex


def deadline_from(timeout_s: float | None, now_unix_s: float) -> float | None:
    return None if timeout_s is None else now_unix_s + timeout_s


# -------------------------------------------------------------------------------- proto -> API


@dataclass(frozen=True)
class EdgeRequest:
    request: InternalRequest
    resume_from_token: int
    resumable: bool  # the client chose the request id, so it can come back for the stream
    fingerprint: str  # identifies the request's content, resume_from_token excluded
    agent: AgentOptions | None = None  # a chat input: tools, tool_choice, response_format
    n: int = 1  # choices (`choices.py`)


def request_from_proto(
    msg: pb.GenerateRequest,
    models: ModelTable,
    tokenizer: Tokenizer,
    *,
    timeout_s: float | None,
    now_unix_s: float | None = None,
) -> EdgeRequest:
    now = time.time() if now_unix_s is None else now_unix_s
    model = models.resolve(msg.model)
    kind = msg.WhichOneof("input")
    if kind is None:
        raise InvalidArgument("one of prompt, prompt_ids or chat is required", field="prompt")
    n = choices_from_proto(msg)
    _check_chat_only_fields(msg, kind)
    raw_ids, agent = _input_ids(msg, kind, model, tokenizer)
    prompt_ids = check_prompt_ids(raw_ids, model, kind)
    continued = v.token_ids(list(msg.continue_ids.ids), "continue_ids", model.vocab_size, empty_ok=True)
    sampling = _guided(sampling_from_proto(msg, model.vocab_size), agent, len(continued))
    check_context(model, len(prompt_ids) + len(continued), sampling.max_tokens, "continue_ids" if continued else kind)
    client_id = check_id(msg.request_id, "request_id")
    request = InternalRequest(
        request_id=client_id or new_request_id(),
        model=model.name,
        prompt_ids=prompt_ids + continued,
        sampling=sampling,
        session_id=check_id(msg.session_id, "session_id"),
        parent_session_id=check_id(msg.parent_session_id, "parent_session_id"),
        deadline_unix_s=deadline_from(timeout_s, now),
        arrival_unix_s=now,
        **_continuation(msg, len(prompt_ids), bool(continued)),
    )
    return EdgeRequest(request, msg.resume_from_token, client_id is not None, fingerprint(msg), agent, n)


def _check_chat_only_fields(msg: pb.GenerateRequest, kind: str) -> None:
    if kind != "chat" and (
        msg.tools or msg.tool_choice or msg.HasField("parallel_tool_calls") or msg.HasField("response_format")
    ):
        raise InvalidArgument("tools, tool_choice and response_format need a chat input", field="chat")


def _input_ids(
    msg: pb.GenerateRequest, kind: str, model: ServedModel, tokenizer: Tokenizer
) -> tuple[list[int], AgentOptions | None]:
    """The prompt's token ids from the input `kind`, and a chat's agent options (else None)."""
    if kind == "chat":
        body = chat_body_from_proto(msg)
        agent = agent_options(body, chat=True)
        if not body["messages"]:
            raise InvalidArgument("must hold at least one message", field="chat.messages")
        v.check_text_budget(sum(len(m.content) for m in msg.chat.messages), model.context_tokens, "chat.messages")
        return tokenizer.encode(
            deepseek_chat_prompt(body["messages"], agent.prompt_tools, agent.response_schema)
        ), agent
    if kind == "prompt":
        v.as_text(msg.prompt, "prompt", empty_ok=False)
        v.check_text_budget(len(msg.prompt), model.context_tokens, "prompt")
        return tokenizer.encode(msg.prompt), None
    raw_ids = list(msg.prompt_ids.ids)
    if len(raw_ids) > model.context_tokens:
        raise InvalidArgument(
            f"{len(raw_ids)} tokens exceed the context limit of {model.context_tokens} tokens", field=kind
        )
    return raw_ids, None


def _guided(sampling: SamplingParams, agent: AgentOptions | None, num_continued: int) -> SamplingParams:
    """A chat's grammar (if any) on the sampling; after `num_continued` tokens already received,
    the grammar resumes past them."""
    if agent is None:
        return sampling
    guided = agent.guided
    if guided is not None and num_continued:
        guided = dataclasses.replace(guided, replay_tokens=guided.replay_tokens + num_continued)
    return dataclasses.replace(sampling, guided=guided)


def choices_from_proto(msg: pb.GenerateRequest) -> int:
    """`n` (unset: 1); an n > 1 stream is not resumable by the client (the server still
    continues each choice itself when a worker fails)."""
    n = v.as_int(msg.n, "n", 1, MAX_N) if msg.HasField("n") else 1
    if n > 1 and msg.resume_from_token:
        raise InvalidArgument("a stream of n > 1 choices cannot be resumed", field="resume_from_token")
    if n > 1 and msg.continue_ids.ids:
        raise InvalidArgument("a stream of n > 1 choices cannot be continued", field="continue_ids")
    return n


def chat_body_from_proto(msg: pb.GenerateRequest) -> dict:
    """The chat fields as the OpenAI body they mirror, for the one validation model
    (`agent_fields.py`) and the chat template; field names in refusals are the OpenAI ones."""
    body: dict = {"messages": [_message_from_proto(m) for m in msg.chat.messages]}
    if msg.tools:
        body["tools"] = [_tool_from_proto(t, i) for i, t in enumerate(msg.tools)]
    if msg.tool_choice:
        body["tool_choice"] = (
            msg.tool_choice
            if msg.tool_choice in ("none", "auto", "required")
            else {"type": "function", "function": {"name": msg.tool_choice}}
        )
    if msg.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = msg.parallel_tool_calls
    if msg.HasField("response_format"):
        body["response_format"] = _response_format_from_proto(msg.response_format)
    return body


def _message_from_proto(m: pb.ChatMessage) -> dict:
    message: dict = {"role": m.role, "content": m.content}
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    if m.name:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]
    return message


def _tool_from_proto(t: pb.Tool, i: int) -> dict:
    function = {"name": t.name, "description": t.description, "strict": t.strict}
    if t.parameters_json:
        function["parameters"] = _json_field(t.parameters_json, f"tools[{i}].function.parameters")
    return {"type": "function", "function": function}


def _response_format_from_proto(rf: pb.ResponseFormat) -> dict:
    body = {"type": rf.type or "text"}
    if rf.type == "json_schema":
        body["json_schema"] = {
            "name": rf.name,
            "strict": rf.strict,
            "schema": _json_field(rf.schema_json or "{}", "response_format.json_schema.schema"),
        }
    return body


def _json_field(text: str, field: str):
    try:
        return json.loads(text)
    except ValueError:
        raise InvalidArgument("must be JSON text", field=field) from None


def calls_to_proto(final: pb.Final, text: str, agent: AgentOptions) -> None:
    """A chat-with-tools Final: the tool calls parsed from the whole completion text."""
    content, calls = dsml.parse(text)
    if not calls:
        return
    calls = calls if agent.parallel_tool_calls else calls[:1]
    final.tool_calls.extend(pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls)
    final.content = content
    if final.finish_reason == pb.FINISH_REASON_STOP:
        final.finish_reason = pb.FINISH_REASON_TOOL_CALLS


def _continuation(msg: pb.GenerateRequest, prompt_tokens: int, continued: bool) -> dict:
    """A client's own continuation (continue_ids): the KV boundary is the original prompt,
    and the prefill's credit is capped at the broken stream's (`InternalRequest`)."""
    if not continued:
        if msg.HasField("continue_prefill_credit_tokens"):
            raise InvalidArgument("is only valid with continue_ids", field="continue_prefill_credit_tokens")
        return {}
    credit = msg.continue_prefill_credit_tokens if msg.HasField("continue_prefill_credit_tokens") else None
    return {"kv_prompt_tokens": prompt_tokens, "max_prefill_credit_tokens": credit}


def sampling_from_proto(msg: pb.GenerateRequest, vocab_size: int) -> SamplingParams:
    """Through the same validation model as the OpenAI API (`validation.sampling_params`)."""
    floats = ("temperature", "top_p", "min_p")

    def get(name: str):
        if name in ("stop", "stop_token_ids"):
            return list(getattr(msg, name))
        if name == "speculative":  # proto3 string: "" = unset
            return msg.speculative or None
        if not msg.HasField(name):
            return None
        value = getattr(msg, name)
        return _f32(value) if name in floats else value

    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    max_tokens = v.as_int(max_tokens, "max_tokens", 1, v.MAX_TOKENS)
    return v.sampling_params(
        get,
        max_tokens=max_tokens,
        logprobs=v.as_logprobs(msg.logprobs, "logprobs"),
        vocab_size=vocab_size,
        defaults=v.GRPC_DEFAULTS,
        ignore_eos=msg.ignore_eos,
    )


def sampling_to_proto(p: SamplingParams, msg: pb.GenerateRequest) -> None:
    """Write `p` into `msg` (every optional field set explicitly)."""
    msg.max_tokens, msg.temperature, msg.top_k = p.max_tokens, p.temperature, p.top_k
    msg.top_p, msg.min_p = p.top_p, p.min_p
    if p.seed is not None:
        msg.seed = p.seed
    msg.stop_token_ids[:] = p.stop_token_ids
    msg.stop[:] = p.stop
    msg.ignore_eos, msg.logprobs = p.ignore_eos, p.logprobs
    msg.speculative = p.speculative


def _f32(x: float) -> float:
    """float32 wire values back to the decimal the client most likely wrote (0.7, not 0.699..);
    NaN and infinities stay what they are (and are refused)."""
    return float(f"{x:.7g}") if math.isfinite(x) else x


def fingerprint(msg: pb.GenerateRequest) -> str:
    content = pb.GenerateRequest()
    content.CopyFrom(msg)
    content.ClearField("resume_from_token")
    return hashlib.sha256(content.SerializeToString(deterministic=True)).hexdigest()


# -------------------------------------------------------------------------------- API -> proto


def event_to_proto(event: TokenEvent | FinalEvent) -> pb.GenerateResponse:
    if isinstance(event, TokenEvent):
        return pb.GenerateResponse(chunk=token_event_to_proto(event))
    return pb.GenerateResponse(final=final_to_proto(event))


def token_event_to_proto(ev: TokenEvent) -> pb.TokenChunk:
    msg = pb.TokenChunk(
        token_ids=ev.token_ids,
        text=ev.text,
        index=ev.index,
        logprobs=[
            pb.TokenLogprobs(logprob=lp.logprob, top_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top])
            for lp in ev.logprobs
        ],
    )
    if ev.prefill_credit_tokens is not None:
        msg.prefill_credit_tokens = ev.prefill_credit_tokens
    return msg


def token_event_from_proto(msg: pb.TokenChunk) -> TokenEvent:
    return TokenEvent(
        token_ids=tuple(msg.token_ids),
        index=msg.index,
        text=msg.text,
        logprobs=tuple(
            TokenLogprobs(lp.logprob, tuple(zip(lp.top_ids, lp.top_logprobs, strict=True))) for lp in msg.logprobs
        ),
        prefill_credit_tokens=(msg.prefill_credit_tokens if msg.HasField("prefill_credit_tokens") else None),
    )


def final_to_proto(ev: FinalEvent) -> pb.Final:
    return pb.Final(
        finish_reason=FINISH_TO_PROTO[ev.finish_reason],
        usage=pb.Usage(**vars(ev.usage)),
        timeline=pb.Timeline(**ev.timeline.as_dict()),
        prefill_worker=ev.prefill_worker,
        decode_worker=ev.decode_worker,
        request_id=ev.request_id,
        text=ev.text,
    )


def final_from_proto(msg: pb.Final) -> FinalEvent:
    return FinalEvent(
        finish_reason=FINISH_FROM_PROTO[msg.finish_reason],
        usage=Usage(**{f: getattr(msg.usage, f) for f in vars(Usage())}),
        timeline=Timeline(**{f: getattr(msg.timeline, f) for f in Timeline().as_dict()}),
        prefill_worker=msg.prefill_worker,
        decode_worker=msg.decode_worker,
        request_id=msg.request_id,
        text=msg.text,
    )
