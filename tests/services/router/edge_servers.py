"""The router's HTTP and gRPC frontends over a `router_fakes.router_stack`, with the edge options
(API keys, TLS, body limit), plus raw-bytes gRPC calls and a self-signed certificate."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress

import grpc

from flashpd.services.redis_local import free_port
from flashpd.services.router.grpc_server import FIELD_METADATA_KEY, start_grpc_server
from flashpd.services.router.http_app import build_http_app


@contextlib.asynccontextmanager
async def heartbeats(stack, workers, period_s: float = 1.0):
    """Keep the fake workers registered (heartbeats expire) while a long test runs."""

    async def beat():
        while True:
            for worker in workers:
                await stack.publisher.register(worker.stats())
            await asyncio.sleep(period_s)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@contextlib.asynccontextmanager
async def http_server(stack, *, ssl_files=None, **app_kwargs):
    """uvicorn on a free 127.0.0.1 port; yields the base URL."""
    import uvicorn

    app = build_http_app(stack.orchestrator, stack.models, stack.tokenizer, stack.metrics, **app_kwargs)
    port = free_port()
    tls = {} if ssl_files is None else {"ssl_certfile": ssl_files.cert_file, "ssl_keyfile": ssl_files.key_file}
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off", **tls))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield f"{'https' if ssl_files else 'http'}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def grpc_server(stack, **kwargs):
    """The gRPC frontend on a free 127.0.0.1 port; yields the target."""
    frontend = await start_grpc_server(
        stack.orchestrator,
        stack.models,
        stack.tokenizer,
        host="127.0.0.1",
        port=0,
        health_poll_s=0.05,
        metrics=stack.metrics,
        **kwargs,
    )
    try:
        yield f"127.0.0.1:{frontend.port}"
    finally:
        await frontend.stop(grace_s=None)


async def raw_call(
    channel: grpc.aio.Channel, method: str, payload: bytes, *, metadata=None, timeout_s: float = 20.0
) -> tuple[str, str, str | None]:
    """Call `method` with raw request bytes: (status code name, details, flashpd-field)."""
    streaming = method.endswith("/Generate")
    if streaming:
        call = channel.unary_stream(method)(payload, metadata=metadata, timeout=timeout_s)
    else:
        call = channel.unary_unary(method)(payload, metadata=metadata, timeout=timeout_s)
    try:
        if streaming:
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as exc:
        field = dict(exc.trailing_metadata() or ()).get(FIELD_METADATA_KEY)
        return exc.code().name, exc.details() or "", field
    return "OK", "", None


def self_signed(tmp_path) -> tuple[str, str]:
    """(cert_file, key_file) for 127.0.0.1 / localhost."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_file), str(key_file)
