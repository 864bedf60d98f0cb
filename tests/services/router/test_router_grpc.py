"""The gRPC frontend end to end: real grpc.aio server, the SDK's AsyncClient, fake workers."""

import asyncio
import contextlib

import grpc
import pytest
from edge_servers import grpc_server, raw_call, self_signed
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from router_fakes import FakeDecode, FakePrefill, grpc_stack, router_stack

from flashpd.services.api import ResourceExhausted as ServerResourceExhausted
from flashpd.services.router.auth import ApiKeys, TlsFiles
from flashpd_sdk import AsyncClient, Cancelled, DeadlineExceeded, InvalidArgument, ResourceExhausted, Unavailable
from flashpd_sdk._gen import flashpd_pb2 as pb
from flashpd_sdk._gen import flashpd_pb2_grpc as pb_grpc

pytestmark = pytest.mark.net
PROMPT = list(range(1, 200)) * 2


def run_async(coro):
    asyncio.run(asyncio.wait_for(coro, 180))  # a hang guard, not a tolerance


def test_generate_streams_chunks_and_a_final_result(redis_url):
    p, d = FakePrefill("p0", cached_tokens=128), FakeDecode("d0")

    async def main():
        async with grpc_stack(redis_url, [p], [d]) as (stack, target):
            async with AsyncClient(target) as client:
                stream = client.generate(prompt_ids=PROMPT, max_tokens=5, session_id="s1")
                chunks = [c async for c in stream]
                result = stream.result
        offsets = [sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))]
        assert [c.index for c in chunks] == offsets  # chunks may merge tokens under load
        assert result.text == "abcde" and result.output_ids == tuple(b"abcde")
        assert result.finish_reason == "length"
        assert (result.prefill_worker, result.decode_worker) == ("p0", "d0")
        assert result.usage.cached_tokens == 128 and result.usage.prompt_tokens == 398
        assert result.timeline["prefill_ms"] == 2.0 and result.timeline["e2e_ms"] > 0
        assert d.seen[0].session_id == "s1"

    run_async(main())


def test_text_prompt_is_tokenized_by_the_server(redis_url):
    d = FakeDecode("d0")

    async def main():
        async with grpc_stack(redis_url, [FakePrefill("p0")], [d]) as (stack, target):
            async with AsyncClient(target) as client:
                await client.generate(prompt="héllo", max_tokens=2).final()
        assert d.seen[0].prompt_ids == tuple("héllo".encode())

    run_async(main())


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt_ids": []}, "prompt_ids"),
        ({"prompt": "x", "model": "nope"}, "model"),
        ({"prompt": "x", "max_tokens": -4}, "max_tokens"),
        ({"prompt": "x" * 5000}, "prompt"),
        ({"prompt": "x", "temperature": -1.0}, "temperature"),
    ],
)
def test_bad_requests_are_invalid_argument_naming_the_field(redis_url, kwargs, field):
    async def main():
        async with grpc_stack(redis_url, [FakePrefill("p0")], [FakeDecode("d0")]) as (_, target):
            async with AsyncClient(target) as client:
                with pytest.raises(InvalidArgument) as info:
                    await client.generate(**kwargs).final()
        assert info.value.field == field and field in str(info.value)

    run_async(main())


def test_health_reflection_and_models(redis_url):
    async def main():
        async with grpc_stack(redis_url, [FakePrefill("p0")], [FakeDecode("d0")]) as (_, target):
            await asyncio.sleep(0.1)  # one health poll
            async with AsyncClient(target) as client:
                assert await client.health() == "SERVING"
                assert await client.health("flashpd.v1.Generation") == "SERVING"
                models = await client.models()
            assert [(m.id, m.context_tokens, m.vocab_size) for m in models] == [("flash-tiny", 2048, 256)]
            async with grpc.aio.insecure_channel(target) as channel:
                stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
                names = {s.name async for r in replies for s in r.list_services_response.service}
            assert {"flashpd.v1.Generation", "grpc.health.v1.Health"} <= names

    run_async(main())


def test_health_is_not_serving_without_workers(redis_url):
    async def main():
        async with grpc_stack(redis_url, [], [FakeDecode("d0")]) as (_, target):
            await asyncio.sleep(0.1)
            async with grpc.aio.insecure_channel(target) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            async with AsyncClient(target) as client:
                with pytest.raises(Unavailable):
                    await client.generate(prompt="x").final()

    run_async(main())


def test_stream_cancel_aborts_both_legs(redis_url):
    p, d = FakePrefill("p0"), FakeDecode("d0", token_delay_s=0.05)

    async def main():
        async with grpc_stack(redis_url, [p], [d]) as (_, target):
            async with AsyncClient(target) as client:
                stream = client.generate(prompt_ids=PROMPT, max_tokens=20, request_id="rq")
                await anext(stream)
                stream.cancel()
                with pytest.raises(Cancelled):
                    await anext(stream)
                await stream.aclose()
            await asyncio.sleep(0.1)
        assert p.aborted == ["rq"] and d.aborted == ["rq"]

    run_async(main())


def test_abort_rpc_from_another_client_ends_the_stream(redis_url):
    p, d = FakePrefill("p0"), FakeDecode("d0", token_delay_s=0.05)

    async def main():
        async with grpc_stack(redis_url, [p], [d]) as (_, target):
            async with AsyncClient(target) as client, AsyncClient(target) as other:
                stream = client.generate(prompt_ids=PROMPT, max_tokens=20, request_id="rq")
                await anext(stream)
                assert await other.abort("rq") is True
                with pytest.raises(Cancelled):
                    async for _ in stream:
                        continue
                assert await other.abort("rq") is False
        assert p.aborted == ["rq"] and d.aborted == ["rq"]

    run_async(main())


def test_client_deadline_propagates_and_aborts_both_legs(redis_url):
    p, d = FakePrefill("p0", delay_s=3.0), FakeDecode("d0")

    async def main():
        async with grpc_stack(redis_url, [p], [d]) as (_, target):
            async with AsyncClient(target) as client:
                with pytest.raises(DeadlineExceeded):
                    await client.generate(prompt_ids=PROMPT, timeout_s=0.3).final()
            await asyncio.sleep(0.5)
        assert d.seen[0].deadline_unix_s is not None
        assert d.seen[0].deadline_unix_s - d.seen[0].arrival_unix_s == pytest.approx(0.3, abs=0.1)
        assert p.aborted == d.aborted == [d.seen[0].request_id]

    run_async(main())


def test_resource_exhausted_is_typed(redis_url):
    d = FakeDecode("d0", reserve_error=ServerResourceExhausted("KV full"))

    async def main():
        async with grpc_stack(redis_url, [FakePrefill("p0")], [d]) as (_, target):
            async with AsyncClient(target) as client:
                with pytest.raises(ResourceExhausted, match="KV full"):
                    await client.generate(prompt="x").final()

    run_async(main())


def test_broken_stream_resumes_from_a_token_offset(redis_url):
    d = FakeDecode("d0", token_delay_s=0.02)

    async def main():
        async with grpc_stack(redis_url, [FakePrefill("p0")], [d]) as (_, target):
            async with grpc.aio.insecure_channel(target) as channel:
                stub = pb_grpc.GenerationStub(channel)
                req = pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=PROMPT), max_tokens=8, request_id="res-1")
                call = stub.Generate(req)
                first = [await call.read(), await call.read(), await call.read()]
                call.cancel()  # the connection "breaks" after 3 chunks
                received = sum(len(r.chunk.token_ids) for r in first)
                req.resume_from_token = received
                rest = [r async for r in stub.Generate(req)]
            ids = [t for r in first + rest if r.HasField("chunk") for t in r.chunk.token_ids]
            assert bytes(ids) == b"abcdefgh" and rest[-1].HasField("final")
            assert rest[0].chunk.index == received
            assert d.aborted == [] and d.calls.count(("generate", "res-1")) == 1

    run_async(main())


def test_resume_of_an_unknown_stream_is_not_found(redis_url):
    async def main():
        async with grpc_stack(redis_url, [FakePrefill("p0")], [FakeDecode("d0")]) as (_, target):
            async with grpc.aio.insecure_channel(target) as channel:
                stub = pb_grpc.GenerationStub(channel)
                req = pb.GenerateRequest(prompt="x", request_id="nope", resume_from_token=2)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in stub.Generate(req):
                        continue
            assert info.value.code() == grpc.StatusCode.NOT_FOUND

    run_async(main())


# ----------------------------------------------------------------------------- the edge


@contextlib.asynccontextmanager
async def edge_grpc(redis_url, decode=None, **server_kwargs):
    workers = [FakePrefill("p0"), decode or FakeDecode("d0")]
    async with router_stack(redis_url, workers[:1], workers[1:]) as stack:
        async with grpc_server(stack, **server_kwargs) as target:
            yield stack, target


GENERATE = "/flashpd.v1.Generation/Generate"
VALID = pb.GenerateRequest(prompt="hi", max_tokens=2).SerializeToString()


@pytest.mark.parametrize(
    "method,payload",
    [
        (GENERATE, b"\x12\x02\xc3\x28"),  # invalid UTF-8 in the prompt string
        (GENERATE, b"\x20\xff\xff"),  # truncated varint
        (GENERATE, b"\x12\x7fabc"),  # length beyond the end
        ("/flashpd.v1.Generation/Abort", b"\x0a\x02\xff\xfe"),
        ("/flashpd.v1.Generation/ListModels", b"\xff\xff"),
    ],
)
def test_unparsable_messages_are_invalid_argument(redis_url, method, payload):
    async def main():
        async with edge_grpc(redis_url) as (_, target):
            async with grpc.aio.insecure_channel(target) as channel:
                return await raw_call(channel, method, payload)

    code, details, field = asyncio.run(asyncio.wait_for(main(), 30))
    assert (code, field) == ("INVALID_ARGUMENT", "request") and "request" in details


def test_refusals_are_counted_and_unexpected_failures_are_generic(redis_url):
    decode = FakeDecode("d0", generate_error=RuntimeError("secret detail"))

    async def main():
        async with edge_grpc(redis_url, decode=decode) as (stack, target):
            async with grpc.aio.insecure_channel(target) as channel:
                refused = await raw_call(
                    channel, GENERATE, pb.GenerateRequest(prompt="x", seed=2**63).SerializeToString()
                )
                failed = await raw_call(channel, GENERATE, VALID)
            return refused, failed, stack.metrics.exposition().decode()

    refused, failed, metrics = asyncio.run(asyncio.wait_for(main(), 60))
    assert refused[0] == "INVALID_ARGUMENT" and refused[2] == "seed"
    assert failed[0] == "INTERNAL"
    assert "RuntimeError" not in failed[1] and "secret" not in failed[1]
    assert 'flashpd:request_errors_total{code="INVALID_ARGUMENT",model_name="flash-tiny"} 1.0' in metrics


def test_api_key_is_required_except_for_health(redis_url):
    async def main():
        async with edge_grpc(redis_url, api_keys=ApiKeys(["k-123"])) as (_, target):
            async with grpc.aio.insecure_channel(target) as channel:
                none = await raw_call(channel, GENERATE, VALID)
                wrong = await raw_call(channel, GENERATE, VALID, metadata=(("authorization", "Bearer nope"),))
                listed = await raw_call(channel, "/flashpd.v1.Generation/ListModels", b"")
                good = await raw_call(channel, GENERATE, VALID, metadata=(("authorization", "Bearer k-123"),))
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        return none, wrong, listed, good, health

    none, wrong, listed, good, health = asyncio.run(asyncio.wait_for(main(), 30))
    for answer in (none, wrong, listed):
        assert answer[0] == "UNAUTHENTICATED" and "k-123" not in answer[1]
    assert good[0] == "OK"
    assert health.status in (health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING)


def test_tls_serves_only_tls_clients(redis_url, tmp_path):
    cert_file, key_file = self_signed(tmp_path)
    root = open(cert_file, "rb").read()

    async def main():
        async with edge_grpc(redis_url, tls=TlsFiles(cert_file, key_file)) as (_, target):
            creds = grpc.ssl_channel_credentials(root_certificates=root)
            async with grpc.aio.secure_channel(target, creds) as channel:
                secure = await raw_call(channel, GENERATE, VALID)
            async with grpc.aio.insecure_channel(target) as channel:
                plain = await raw_call(channel, GENERATE, VALID, timeout_s=3)
        return secure, plain

    secure, plain = asyncio.run(asyncio.wait_for(main(), 30))
    assert secure[0] == "OK" and plain[0] == "UNAVAILABLE"
