"""The asyncio client against the scripted server."""

import asyncio

import grpc
import pytest
from sdk_fakes import COMPLETE, OUTPUT, ScriptedServer, Step, self_signed_cert

from flashpd_sdk import AsyncClient, Cancelled, ResourceExhausted, RetryPolicy, Unavailable

pytestmark = pytest.mark.net
FAST = RetryPolicy(backoff_s=0.01)


def run_async(coro):
    asyncio.run(asyncio.wait_for(coro, 20))


def test_async_generate_streams_and_returns_the_result(server):
    async def main():
        async with AsyncClient(server.target) as client:
            stream = client.generate(prompt_ids=[5], max_tokens=11, ignore_eos=True)
            chunks = [c async for c in stream]
            result = stream.result
        assert "".join(c.text for c in chunks) == result.text == "hello world"
        assert result.output_ids == tuple(OUTPUT) and server.requests[0].ignore_eos

    run_async(main())


def test_async_result_before_the_end_is_an_error(server):
    async def main():
        async with AsyncClient(server.target) as client:
            stream = client.generate(prompt="x")
            with pytest.raises(RuntimeError, match="not finished"):
                _ = stream.result
            assert (await stream.final()).finish_reason == "length"

    run_async(main())


def test_async_retry_before_first_token_and_resume_after(server):
    server.play(
        Step(fail=grpc.StatusCode.UNAVAILABLE, tokens=0), Step(fail=grpc.StatusCode.UNAVAILABLE, tokens=3), COMPLETE
    )

    async def main():
        async with AsyncClient(server.target, retry=FAST) as client:
            result = await client.generate(prompt="x").final()
        assert result.text == "hello world" and (result.retries, result.resumes) == (1, 1)
        assert [r.resume_from_token for r in server.requests] == [0, 0, 3]

    run_async(main())


def test_async_typed_errors_are_not_retried(server):
    server.play(Step(fail=grpc.StatusCode.RESOURCE_EXHAUSTED, tokens=0), COMPLETE)

    async def main():
        async with AsyncClient(server.target, retry=FAST) as client:
            with pytest.raises(ResourceExhausted):
                await client.generate(prompt="x").final()
        assert len(server.requests) == 1

    run_async(main())


def test_async_retries_give_up_with_unavailable(server):
    server.play(*[Step(fail=grpc.StatusCode.UNAVAILABLE, tokens=0)] * 5)

    async def main():
        async with AsyncClient(server.target, retry=RetryPolicy(max_retries=2, backoff_s=0.01)) as client:
            with pytest.raises(Unavailable):
                await client.generate(prompt="x").final()
        assert len(server.requests) == 3

    run_async(main())


def test_async_cancel_aborts_on_the_server(server):
    server.play(Step(delay_s=0.05))

    async def main():
        async with AsyncClient(server.target) as client:
            stream = client.generate(prompt="x", request_id="mine")
            await anext(stream)
            stream.cancel()
            with pytest.raises(Cancelled):
                await anext(stream)
            await stream.aclose()
        assert server.servicer.aborts == ["mine"]

    run_async(main())


def test_async_abort_health_models(server):
    async def main():
        async with AsyncClient(server.target) as client:
            assert await client.abort("x") is True
            assert await client.health() == "SERVING"
            assert [m.vocab_size for m in await client.models()] == [256]

    run_async(main())


def test_async_resume_refused_continues_from_prompt_ids(server):
    server.play(
        Step(fail=grpc.StatusCode.UNAVAILABLE, tokens=5), Step(fail=grpc.StatusCode.NOT_FOUND, tokens=0), COMPLETE
    )

    async def main():
        async with AsyncClient(server.target, retry=FAST) as client:
            stream = client.generate(prompt_ids=[7, 8], max_tokens=11)
            chunks = [c async for c in stream]
        assert [c.index for c in chunks] == list(range(len(OUTPUT)))
        assert stream.result.output_ids == tuple(OUTPUT)
        cont = server.requests[2]
        assert list(cont.prompt_ids.ids) == [7, 8] and list(cont.continue_ids.ids) == [*OUTPUT[:5]]
        assert server.requests[2].max_tokens == 6

    run_async(main())


def test_async_api_key_is_sent_as_bearer_metadata(server):
    async def main():
        async with AsyncClient(server.target, api_key="secret") as client:
            await client.generate(prompt="x").final()
            await client.abort("some-id")
        assert len(server.metadata) == 2
        assert all(m.get("authorization") == "Bearer secret" for m in server.metadata)

    run_async(main())


def test_async_tls_with_a_root_certificate_file(tmp_path):
    cert, key = self_signed_cert()
    (tmp_path / "ca.pem").write_bytes(cert)

    async def main():
        with ScriptedServer(tls=(cert, key)) as tls_server:
            async with AsyncClient(tls_server.target, tls=str(tmp_path / "ca.pem")) as client:
                assert (await client.generate(prompt="x").final()).text == "hello world"

    run_async(main())
