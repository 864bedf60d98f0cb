"""Synchronous client.

with Client("127.0.0.1:9000") as client:
    stream = client.generate(prompt="Hello", max_tokens=32, session_id="chat-1")
    for chunk in stream:
        print(chunk.text, end="")
    print(stream.result.usage)

    stream = client.generate(messages=[...], n=3, temperature=1.0)  # three choices
    for chunk in stream:  # interleaved; chunk.choice_index says whose
        ...
    texts = [c.text for c in stream.choices]; print(stream.usage)
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterator, Sequence

import grpc

from flashpd_sdk import _health
from flashpd_sdk._gen import flashpd_pb2 as pb
from flashpd_sdk._gen import flashpd_pb2_grpc as pb_grpc
from flashpd_sdk._wire import (
    DEFAULT_RETRY,
    ClientCore,
    RetryPolicy,
    StreamState,
    call_metadata,
    channel_credentials,
    channel_options,
)
from flashpd_sdk.errors import Cancelled, from_rpc_error
from flashpd_sdk.types import GenerateResult, ModelInfo, ResponseFormat, TokenChunk, Tool, Usage

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0


class GenerateStream:
    """Iterate for TokenChunks; `result` afterwards (reading it early drains the stream)."""

    def __init__(self, stub: pb_grpc.GenerationStub, metadata: tuple, state: StreamState) -> None:
        self._stub, self._state, self._metadata = stub, state, metadata
        self._call = None
        self._cancelled = threading.Event()
        self._chunks = self._run()

    @property
    def request_id(self) -> str:
        return self._state.request_id

    def __iter__(self) -> Iterator[TokenChunk]:
        return self

    def __next__(self) -> TokenChunk:
        return next(self._chunks)

    @property
    def result(self) -> GenerateResult:
        """The result (n > 1: choice 0's; see `choices`); drains the stream."""
        collections.deque(self._chunks, maxlen=0)  # drain: the result comes with the final
        assert self._state.result is not None
        return self._state.result

    @property
    def choices(self) -> tuple[GenerateResult, ...]:
        """One result per choice, in index order (n = 1: the result alone); drains the stream."""
        collections.deque(self._chunks, maxlen=0)
        return self._state.choices

    @property
    def usage(self) -> Usage:
        """The request's usage as OpenAI counts it (n > 1: the prompt once, every choice's
        completion tokens summed); drains the stream."""
        collections.deque(self._chunks, maxlen=0)
        assert self._state.total_usage is not None
        return self._state.total_usage

    def cancel(self) -> None:
        """Stop the stream and abort the request on the server (both legs). Thread-safe."""
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        try:  # abort first: the server then frees both legs at once, resumable or not
            self._stub.Abort(
                pb.AbortRequest(request_id=self.request_id), timeout=ABORT_TIMEOUT_S, metadata=self._metadata
            )
        except grpc.RpcError as exc:  # best effort: cancelling the call below ends it anyway
            log.info("abort of %s failed: %s", self.request_id, exc)
        if self._call is not None:
            self._call.cancel()

    def _run(self) -> Iterator[TokenChunk]:
        state = self._state
        while True:
            if self._cancelled.is_set():
                raise Cancelled("cancelled by the client")
            self._call = self._stub.Generate(state.next_request(), timeout=state.remaining_s(), metadata=self._metadata)
            try:
                for resp in self._call:
                    chunk = state.on_response(resp)
                    if chunk is not None:
                        yield chunk
                    if state.done:  # every Final arrived (n > 1: one per choice)
                        return
                state.on_stream_end()
                return
            except grpc.RpcError as exc:
                if self._cancelled.is_set():
                    raise Cancelled("cancelled by the client") from None
                error = from_rpc_error(exc)
                if state.next_action(error) == "raise":
                    raise state.reported(error) from None
                time.sleep(state.pause_s())


class Client(ClientCore):
    def __init__(
        self,
        target: str,
        *,
        keepalive_s: float = 30.0,
        default_timeout_s: float | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
        api_key: str | None = None,
        tls: bool | str = False,
        tls_server_name: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        """`api_key`: sent as `authorization: Bearer <key>`; `tls`: True (system roots) or a
        PEM root certificate path; `tls_server_name`: the name in the server's certificate when
        it differs from the target host; `credentials`: any channel credentials instead."""
        options = channel_options(keepalive_s, tls_server_name)
        creds = channel_credentials(tls, credentials)
        channel = grpc.secure_channel(target, creds, options) if creds else grpc.insecure_channel(target, options)
        self._attach(channel, default_timeout_s, retry, call_metadata(api_key))

    def generate(
        self,
        prompt: str | None = None,
        prompt_ids: Sequence[int] | None = None,
        *,
        max_tokens: int = 16,
        temperature: float = 0.0,
        seed: int | None = None,
        session_id: str | None = None,
        parent_session_id: str | None = None,
        ignore_eos: bool = False,
        stop: Sequence[str] | str | None = None,
        timeout_s: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        stop_token_ids: Sequence[int] | None = None,
        logprobs: int = 0,
        request_id: str | None = None,
        model: str = "",
        messages: Sequence[dict] | None = None,
        tools: Sequence[Tool | dict] | None = None,
        tool_choice: str | None = None,
        parallel_tool_calls: bool | None = None,
        response_format: ResponseFormat | None = None,
        n: int = 1,
    ) -> GenerateStream:
        return GenerateStream(
            self._stub,
            self._metadata,
            self._stream_state(
                timeout_s,
                model=model,
                prompt=prompt,
                prompt_ids=prompt_ids,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                min_p=min_p,
                seed=seed,
                stop=stop,
                stop_token_ids=stop_token_ids,
                ignore_eos=ignore_eos,
                logprobs=logprobs,
                session_id=session_id,
                parent_session_id=parent_session_id,
                request_id=request_id,
                messages=messages,
                tools=tools,
                tool_choice=tool_choice,
                parallel_tool_calls=parallel_tool_calls,
                response_format=response_format,
                n=n,
            ),
        )

    def abort(self, request_id: str, *, timeout_s: float = ABORT_TIMEOUT_S) -> bool:
        """Abort a running request by id; False if the server does not know it (any more)."""
        return self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id), timeout_s).found

    def health(self, service: str = "", *, timeout_s: float = 5.0) -> str:
        """grpc.health.v1 status: "SERVING", "NOT_SERVING", "UNKNOWN" or "SERVICE_UNKNOWN"."""
        reply = self._unary(self._health, _health.HealthCheckRequest(service=service), timeout_s)
        return _health.status_name(reply)

    def models(self, *, timeout_s: float = 5.0) -> list[ModelInfo]:
        reply = self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout_s)
        return [ModelInfo(m.id, m.context_tokens, m.vocab_size) for m in reply.models]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unary(self, method, request, timeout_s: float):
        try:
            return method(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
