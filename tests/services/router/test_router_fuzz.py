"""Hostile requests (services/router/fuzz_cases.py) against the in-process router, HTTP and gRPC,
with fake workers: no 5xx / INTERNAL / UNKNOWN, refusals name their field, no internals in any
error body."""

import asyncio
import collections

import grpc
import httpx
import pytest
from edge_servers import grpc_server, heartbeats, http_server, raw_call
from router_fakes import SERVED, FakeDecode, FakePrefill, router_stack

from flashpd.services.router.fuzz_cases import HostileRequest, grpc_verdict, hostile_requests, http_verdict

pytestmark = pytest.mark.net


def test_generator_is_deterministic_and_covers_both_protocols():
    a, b = hostile_requests(3), hostile_requests(3)
    assert a == b and len(a) >= 500
    counts = collections.Counter(c.protocol for c in a)
    assert counts["http"] >= 300 and counts["grpc"] >= 100
    assert hostile_requests(4) != a  # the seed drives the random part


@pytest.mark.parametrize(
    "case,status,body,problem",
    [
        (HostileRequest("http", "c", "n"), 500, b"{}", "server error"),
        (HostileRequest("http", "c", "n"), 200, b"{}", "accepted"),
        (HostileRequest("http", "c", "n"), 400, b'{"detail": "x"}', "error shape"),
        (
            HostileRequest("http", "c", "n", field="top_p"),
            400,
            b'{"error": {"message": "seed: bad", "param": "seed"}}',
            "expected 'top_p'",
        ),
        (HostileRequest("http", "c", "n"), 400, b'{"error": {"message": "ValueError: x", "param": null}}', "internals"),
        (HostileRequest("http", "c", "n", expect="any"), 200, b"{}", None),
    ],
)
def test_http_verdict_catches_each_kind_of_problem(case, status, body, problem):
    verdict = http_verdict(case, status, body)
    assert (verdict is None) if problem is None else (problem in verdict)


def test_grpc_verdict_catches_each_kind_of_problem():
    case = HostileRequest("grpc", "c", "n", field="seed")
    assert "server fault" in grpc_verdict(case, "UNKNOWN", "")
    assert "server fault" in grpc_verdict(case, "INTERNAL", "")
    assert "accepted" in grpc_verdict(case, "OK", "")
    assert "internals" in grpc_verdict(case, "INVALID_ARGUMENT", "Traceback (most recent")
    assert "expected 'seed'" in grpc_verdict(case, "INVALID_ARGUMENT", "top_p: x", "top_p")
    assert grpc_verdict(case, "INVALID_ARGUMENT", "seed: too big", "seed") is None


def test_hostile_requests_get_client_errors_only(redis_url):
    cases = hostile_requests(0, vocab_size=SERVED.vocab_size)
    problems: list[str] = []

    async def main():
        workers = [FakePrefill("p0"), FakeDecode("d0")]
        async with router_stack(redis_url, workers[:1], workers[1:]) as stack:
            async with heartbeats(stack, workers), http_server(stack) as url, grpc_server(stack) as target:
                async with (
                    httpx.AsyncClient(base_url=url, timeout=30) as http,
                    grpc.aio.insecure_channel(target) as channel,
                ):
                    for case in cases:
                        problems.append(await _send(case, http, channel))
                    await _send(cases[0], http, channel)  # still serving afterwards

    asyncio.run(asyncio.wait_for(main(), 600))
    bad = [p for p in problems if p is not None]
    assert not bad, f"{len(bad)} of {len(cases)}:\n" + "\n".join(bad[:20])


async def _send(case: HostileRequest, http: httpx.AsyncClient, channel: grpc.aio.Channel) -> str | None:
    if case.protocol == "http":
        r = await http.request(case.method, case.path, headers=list(case.headers), content=case.body)
        return http_verdict(case, r.status_code, r.content)
    code, details, field = await raw_call(channel, case.grpc_method, case.grpc_payload)
    return grpc_verdict(case, code, details, field)
