"""Edge conversion: the one place where wire types (proto/flashpd.proto) meet the internal API,
plus the chat template and the checks on prompts and context shared by the gRPC and HTTP
frontends (field limits live in `validation.py`).

Validation errors are `InvalidArgument` with `field` set to the request field at fault.
"""

from __future__ import annotations

import hashlib
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
from flashpd.services.router import validation as v
from flashpd.services.router.text import Tokenizer
from flashpd_sdk._gen import flashpd_pb2 as pb

DEFAULT_MAX_TOKENS = 16
MAX_ID_CHARS = v.MAX_ID_CHARS  # request and session ids

# DeepSeek-style chat markers, as plain strings (the tokenizer maps them to special tokens).
BOS = "<|begin_of_sentence|>"
EOS = "<|end_of_sentence|>"
USER = "<|User|>"
ASSISTANT = "<|Assistant|>"
CHAT_ROLES = ("system", "developer", "user", "assistant")  # developer = OpenAI's new system

FINISH_TO_PROTO = {
    "stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
FINISH_FROM_PROTO = {v: k for k, v in FINISH_TO_PROTO.items()}


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
            raise v.ModelNotFound(f"the model {v.show(name)} does not exist; served: "
                                  f"{sorted(self._by_name)}", field="model")
        return self._by_name[name]


# ------------------------------------------------------------------------------- chat template


def deepseek_chat_prompt(messages: Sequence[dict]) -> str:
    """DeepSeek-style prompt: BOS, system text, then `<|User|>u<|Assistant|>a<|end_of_sentence|>`
    per turn, ending with `<|Assistant|>` so the model writes the next assistant turn."""
    if not messages:
        raise InvalidArgument("must contain at least one message", field="messages")
    system, turns = [], []
    for i, message in enumerate(messages):
        role, content = _message_parts(message, i)
        if role in ("system", "developer"):
            system.append(content)
        elif role == "user":
            turns.append(USER + content)
        else:
            turns.append(ASSISTANT + content + EOS)
    return BOS + "\n\n".join(system) + "".join(turns) + ASSISTANT


def _message_parts(message: object, i: int) -> tuple[str, str]:
    if not isinstance(message, dict):
        raise InvalidArgument("must be an object with role and content", field=f"messages[{i}]")
    role = message.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise InvalidArgument(f"must be one of {list(CHAT_ROLES)}, got {v.show(role)}",
                              field=f"messages[{i}].role")
    for unsupported in ("tool_calls", "function_call", "audio"):
        if message.get(unsupported) is not None:
            raise InvalidArgument("is not supported by this server",
                                  field=f"messages[{i}].{unsupported}")
    if message.get("name") is not None:
        v.as_text(message["name"], f"messages[{i}].name", max_chars=256)
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts: only text parts are supported
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise InvalidArgument("only text content parts are supported",
                                  field=f"messages[{i}].content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise InvalidArgument("must be a string or a list of text parts",
                              field=f"messages[{i}].content")
    v.check_unicode(content, f"messages[{i}].content")
    return role, content


# ---------------------------------------------------------------------------------- validation


def check_prompt_ids(ids: Sequence[int], model: ServedModel, field: str) -> tuple[int, ...]:
    return v.token_ids(list(ids), field, model.vocab_size)


def check_context(model: ServedModel, prompt_tokens: int, max_tokens: int, prompt_field: str, *,
                  max_tokens_field: str = "max_tokens") -> None:
    if prompt_tokens > model.context_tokens:
        raise InvalidArgument(f"{prompt_tokens} tokens exceed the context limit of "
                              f"{model.context_tokens} tokens", field=prompt_field)
    if prompt_tokens + max_tokens > model.context_tokens:
        raise InvalidArgument(
            f"prompt ({prompt_tokens}) + {max_tokens_field} ({max_tokens}) exceeds the context "
            f"limit of {model.context_tokens} tokens", field=max_tokens_field)


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


def request_from_proto(msg: pb.GenerateRequest, models: ModelTable, tokenizer: Tokenizer, *,
                       timeout_s: float | None, now_unix_s: float | None = None) -> EdgeRequest:
    now = time.time() if now_unix_s is None else now_unix_s
    model = models.resolve(msg.model)
    kind = msg.WhichOneof("input")
    if kind is None:
        raise InvalidArgument("one of prompt or prompt_ids is required", field="prompt")
    if kind == "prompt":
        v.as_text(msg.prompt, "prompt", empty_ok=False)
        v.check_text_budget(len(msg.prompt), model.context_tokens, "prompt")
        raw_ids = tokenizer.encode(msg.prompt)
    else:
        raw_ids = list(msg.prompt_ids.ids)
        if len(raw_ids) > model.context_tokens:
            raise InvalidArgument(f"{len(raw_ids)} tokens exceed the context limit of "
                                  f"{model.context_tokens} tokens", field=kind)
    prompt_ids = check_prompt_ids(raw_ids, model, kind)
    continued = v.token_ids(list(msg.continue_ids.ids), "continue_ids", model.vocab_size,
                            empty_ok=True)
    sampling = sampling_from_proto(msg, model.vocab_size)
    check_context(model, len(prompt_ids) + len(continued), sampling.max_tokens,
                  "continue_ids" if continued else kind)
    client_id = check_id(msg.request_id, "request_id")
    request = InternalRequest(
        request_id=client_id or new_request_id(), model=model.name,
        prompt_ids=prompt_ids + continued,
        sampling=sampling, session_id=check_id(msg.session_id, "session_id"),
        parent_session_id=check_id(msg.parent_session_id, "parent_session_id"),
        deadline_unix_s=deadline_from(timeout_s, now), arrival_unix_s=now,
        **_continuation(msg, len(prompt_ids), bool(continued)))
    return EdgeRequest(request, msg.resume_from_token, client_id is not None, fingerprint(msg))


def _continuation(msg: pb.GenerateRequest, prompt_tokens: int, continued: bool) -> dict:
    """A client's own continuation (continue_ids): the KV boundary is the original prompt,
    and the prefill's credit is capped at the broken stream's (`InternalRequest`)."""
    if not continued:
        if msg.HasField("continue_prefill_credit_tokens"):
            raise InvalidArgument("is only valid with continue_ids",
                                  field="continue_prefill_credit_tokens")
        return {}
    credit = (msg.continue_prefill_credit_tokens
              if msg.HasField("continue_prefill_credit_tokens") else None)
    return {"kv_prompt_tokens": prompt_tokens, "max_prefill_credit_tokens": credit}


def sampling_from_proto(msg: pb.GenerateRequest, vocab_size: int) -> SamplingParams:
    """Through the same validation model as the OpenAI API (`validation.sampling_params`)."""
    floats = ("temperature", "top_p", "min_p")

    def get(name: str):
        if name in ("stop", "stop_token_ids"):
            return list(getattr(msg, name))
        if not msg.HasField(name):
            return None
        value = getattr(msg, name)
        return _f32(value) if name in floats else value

    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    max_tokens = v.as_int(max_tokens, "max_tokens", 1, v.MAX_TOKENS)
    return v.sampling_params(get, max_tokens=max_tokens, logprobs=v.as_logprobs(
        msg.logprobs, "logprobs"), vocab_size=vocab_size, defaults=v.GRPC_DEFAULTS,
        ignore_eos=msg.ignore_eos)


def sampling_to_proto(p: SamplingParams, msg: pb.GenerateRequest) -> None:
    """Write `p` into `msg` (every optional field set explicitly)."""
    msg.max_tokens, msg.temperature, msg.top_k = p.max_tokens, p.temperature, p.top_k
    msg.top_p, msg.min_p = p.top_p, p.min_p
    if p.seed is not None:
        msg.seed = p.seed
    msg.stop_token_ids[:] = p.stop_token_ids
    msg.stop[:] = p.stop
    msg.ignore_eos, msg.logprobs = p.ignore_eos, p.logprobs


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
        token_ids=ev.token_ids, text=ev.text, index=ev.index,
        logprobs=[pb.TokenLogprobs(logprob=lp.logprob, top_ids=[t for t, _ in lp.top],
                                   top_logprobs=[v for _, v in lp.top]) for lp in ev.logprobs])
    if ev.prefill_credit_tokens is not None:
        msg.prefill_credit_tokens = ev.prefill_credit_tokens
    return msg


def token_event_from_proto(msg: pb.TokenChunk) -> TokenEvent:
    return TokenEvent(
        token_ids=tuple(msg.token_ids), index=msg.index, text=msg.text,
        logprobs=tuple(TokenLogprobs(lp.logprob, tuple(zip(lp.top_ids, lp.top_logprobs,
                                                           strict=True)))
                       for lp in msg.logprobs),
        prefill_credit_tokens=(msg.prefill_credit_tokens
                               if msg.HasField("prefill_credit_tokens") else None))


def final_to_proto(ev: FinalEvent) -> pb.Final:
    return pb.Final(
        finish_reason=FINISH_TO_PROTO[ev.finish_reason],
        usage=pb.Usage(**vars(ev.usage)), timeline=pb.Timeline(**ev.timeline.as_dict()),
        prefill_worker=ev.prefill_worker, decode_worker=ev.decode_worker,
        request_id=ev.request_id, text=ev.text)


def final_from_proto(msg: pb.Final) -> FinalEvent:
    return FinalEvent(
        finish_reason=FINISH_FROM_PROTO[msg.finish_reason],
        usage=Usage(**{f: getattr(msg.usage, f) for f in vars(Usage())}),
        timeline=Timeline(**{f: getattr(msg.timeline, f) for f in Timeline().as_dict()}),
        prefill_worker=msg.prefill_worker, decode_worker=msg.decode_worker,
        request_id=msg.request_id, text=msg.text)
