"""An ASGI guard for Ray Serve's HTTP proxy: refuses, in OpenAI's error shape, what the proxy
itself would answer with a 500 or carry to a replica for nothing.

Serve's proxy decodes the `x-request-id` and `x-session-id` headers (and its multiplexed-model
header) as UTF-8 before our app sees the request, so a latin-1 byte there is a 500 from the proxy.
The guard answers 400 naming the header instead, for every header the router reads (ids: 1..128
printable ASCII characters, as `validation.as_id`), and 413 for a declared body over
`validation.MAX_BODY_BYTES` before the proxy reads and ships it to a replica.

Installed through Serve's proxy-callback hook: the proxy processes need
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=flashpd.services.router.http_guard:proxy_middlewares`
in their environment (`flashpd serve` sets it before starting Ray; on a cluster, set it in the
Ray nodes' environment). The app repeats every check behind the proxy, so the guard only moves
refusals earlier.
"""

from __future__ import annotations

import json

from starlette.middleware import Middleware

from flashpd.services.router import validation as v

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK_PATH = "flashpd.services.router.http_guard:proxy_middlewares"
ID_HEADERS = (b"x-request-id", b"x-session-id", b"x-parent-session-id")
UTF8_HEADERS = (b"serve_multiplexed_model_id", b"serve-multiplexed-model-id")
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024  # a refused body is read (and dropped) up to this much


def proxy_middlewares() -> list[Middleware]:
    """The proxy callback (see the module docstring)."""
    return [Middleware(HeaderGuard)]


class HeaderGuard:
    """Pure ASGI middleware (no body buffering, streaming untouched)."""

    def __init__(self, app, max_body_bytes: int = v.MAX_BODY_BYTES) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(scope.get("headers") or ())
            if refusal is not None:
                await _drain(receive, DRAIN_LIMIT_BYTES)  # so the client gets to read the answer
                await _send_error(send, *refusal)
                return
        await self.app(scope, receive, send)

    def refusal(self, headers) -> tuple[int, str, str] | None:
        """(status, field, message) for the first bad header, else None."""
        for raw_key, value in headers:
            key = raw_key.lower()
            if key in ID_HEADERS and not _is_id(value):
                return (
                    400,
                    key.decode("ascii", "replace"),
                    f"must be at most {v.MAX_ID_CHARS} printable ASCII characters without spaces",
                )
            if key in UTF8_HEADERS and not _utf8(value):
                return 400, key.decode("ascii", "replace"), "must be UTF-8 text"
            if key == b"content-length":
                if not value.isdigit():
                    return 400, "content-length", "must be a non-negative integer"
                if int(value) > self.max_body_bytes:
                    return (413, "body", f"request body of {int(value)} bytes exceeds {self.max_body_bytes} bytes")
        return None


def _is_id(value: bytes) -> bool:
    return len(value) <= v.MAX_ID_CHARS and all(33 <= b < 127 for b in value)


def _utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


async def _drain(receive, limit_bytes: int) -> None:
    """Read and drop the request body: a client still uploading when the connection closed
    would see a reset instead of the refusal."""
    received = 0
    while received <= limit_bytes:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        received += len(message.get("body", b""))


async def _send_error(send, status: int, field: str, message: str) -> None:
    body = json.dumps(
        {
            "error": {
                "message": f"{field}: {message}",
                "type": "invalid_request_error",
                "param": field,
                "code": "invalid_argument",
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
