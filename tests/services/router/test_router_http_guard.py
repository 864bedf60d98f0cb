"""The guard in front of Serve's HTTP proxy (services/router/http_guard.py), as plain ASGI."""

import asyncio

import httpx
import pytest

from flashpd.services.router.http_guard import HeaderGuard, proxy_middlewares


async def ok_app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def post(headers, body=b"{}", max_body_bytes=1000):
    async def main():
        transport = httpx.ASGITransport(app=HeaderGuard(ok_app, max_body_bytes=max_body_bytes))
        async with httpx.AsyncClient(transport=transport, base_url="http://guard") as http:
            return await http.post("/v1/completions", headers=headers, content=body)

    return asyncio.run(main())


@pytest.mark.parametrize("header", [b"x-request-id", b"x-session-id", b"x-parent-session-id", b"X-Session-Id"])
@pytest.mark.parametrize("value", [b"caf\xe9", b"\xff", b"a b", b"x" * 129])
def test_bad_id_headers_are_400_naming_the_header(header, value):
    r = post([(header, value)])
    assert r.status_code == 400
    assert r.json()["error"]["param"] == header.decode().lower()


def test_multiplexed_model_header_must_be_utf8():
    r = post([(b"serve_multiplexed_model_id", b"\xff")])
    assert r.status_code == 400 and r.json()["error"]["param"] == "serve_multiplexed_model_id"


def test_declared_body_over_the_limit_is_413():
    r = post([], body=b"x" * 1001)
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"


def test_good_requests_pass_through():
    r = post([(b"x-session-id", b"chat-9"), (b"x-request-id", b"r-1")], body=b"x" * 1000)
    assert r.status_code == 200 and r.text == "ok"


def test_the_proxy_callback_returns_starlette_middlewares():
    from starlette.middleware import Middleware

    (mw,) = proxy_middlewares()
    assert isinstance(mw, Middleware) and mw.cls is HeaderGuard
