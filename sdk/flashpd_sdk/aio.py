"""asyncio client (grpc.aio); same API as `Client`, awaited.

async with AsyncClient("127.0.0.1:9000") as client:
    stream = client.generate(prompt_ids=[1, 2, 3], max_tokens=8)
    async for chunk in stream:
        ...
    result = stream.result
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

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


class AsyncGenerateStream:
    """`async for` for TokenChunks; `result` once iteration ended (or `await final()`)."""

    def __init__(self, stub: pb_grpc.GenerationStub, metadata: tuple, state: StreamState) -> None:
        self._stub, self._state, self._metadata = stub, state, metadata
        self._call = None
        self._cancelled = False
        self._abort_task: asyncio.Task | None = None
        self._chunks = self._run()

    @property
    def request_id(self) -> str:
        return self._state.request_id

    def __aiter__(self) -> AsyncIterator[TokenChunk]:
        return self

    async def __anext__(self) -> TokenChunk:
        return await self._chunks.__anext__()

    @property
    def result(self) -> GenerateResult:
        if self._state.result is None:
            raise RuntimeError("the stream has not finished; iterate it or await final()")
        return self._state.result

    async def final(self) -> GenerateResult:
        """Drain the stream and return the result (n > 1: choice 0's)."""
        async for _ in self._chunks:
            continue
        return self.result

    async def final_choices(self) -> tuple[GenerateResult, ...]:
        """Drain the stream and return one result per choice, in index order."""
        await self.final()
        return self._state.choices

    @property
    def choices(self) -> tuple[GenerateResult, ...]:
        """One result per choice (once iteration ended)."""
        self.result  # noqa: B018 - raises while the stream is unfinished
        return self._state.choices

    @property
    def usage(self) -> Usage:
        """The request's usage as OpenAI counts it (n > 1: the prompt once, every choice's
        completion tokens summed), once iteration ended."""
        self.result  # noqa: B018 - raises while the stream is unfinished
        assert self._state.total_usage is not None
        return self._state.total_usage

    def cancel(self) -> None:
        """Stop the stream and abort the request on the server (the Abort RPC runs in the
        background; `await aclose()` to wait for it)."""
        if self._cancelled:
            return
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()
        self._abort_task = asyncio.ensure_future(self._abort())

    async def aclose(self) -> None:
        if self._state.result is None:
            self.cancel()
        if self._abort_task is not None:
            await self._abort_task
        await self._chunks.aclose()

    async def _abort(self) -> None:
        try:
            await self._stub.Abort(
                pb.AbortRequest(request_id=self.request_id), timeout=ABORT_TIMEOUT_S, metadata=self._metadata
            )
        except grpc.RpcError as exc:  # best effort: the cancelled call already ended the stream
            log.info("abort of %s after cancel failed: %s", self.request_id, exc)

    async def _run(self) -> AsyncIterator[TokenChunk]:
        state = self._state
        while True:
            if self._cancelled:
                raise Cancelled("cancelled by the client")
            self._call = self._stub.Generate(state.next_request(), timeout=state.remaining_s(), metadata=self._metadata)
            try:
                async for resp in self._call:
                    chunk = state.on_response(resp)
                    if chunk is not None:
                        yield chunk
                    if state.done:  # every Final arrived (n > 1: one per choice)
                        return
                state.on_stream_end()
                return
            except asyncio.CancelledError:
                if self._cancelled:  # our own call.cancel(), not the caller's task
                    raise Cancelled("cancelled by the client") from None
                raise
            except grpc.RpcError as exc:
                if self._cancelled:
                    raise Cancelled("cancelled by the client") from None
                error = from_rpc_error(exc)
                if state.next_action(error) == "raise":
                    raise state.reported(error) from None
                await asyncio.sleep(state.pause_s())


class AsyncClient(ClientCore):
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
        channel = (
            grpc.aio.secure_channel(target, creds, options) if creds else grpc.aio.insecure_channel(target, options)
        )
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
    ) -> AsyncGenerateStream:
        return AsyncGenerateStream(
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

    async def abort(self, request_id: str, *, timeout_s: float = ABORT_TIMEOUT_S) -> bool:
        reply = await self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id), timeout_s)
        return reply.found

    async def health(self, service: str = "", *, timeout_s: float = 5.0) -> str:
        reply = await self._unary(self._health, _health.HealthCheckRequest(service=service), timeout_s)
        return _health.status_name(reply)

    async def models(self, *, timeout_s: float = 5.0) -> list[ModelInfo]:
        reply = await self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout_s)
        return [ModelInfo(m.id, m.context_tokens, m.vocab_size) for m in reply.models]

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _unary(self, method, request, timeout_s: float):
        try:
            return await method(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
