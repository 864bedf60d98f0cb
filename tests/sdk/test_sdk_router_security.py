"""The SDK's security options against the real gRPC router (fake workers behind it): an API key
sent as `authorization: Bearer <key>` over TLS with a root certificate file."""

import asyncio
import sys
from pathlib import Path

import pytest
from sdk_fakes import self_signed_cert

from flashpd.services.router.auth import ApiKeys, TlsFiles
from flashpd.services.router.grpc_server import start_grpc_server
from flashpd_sdk import AsyncClient, Unauthenticated

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "services" / "router"))
from router_fakes import FakeDecode, FakePrefill, router_stack  # noqa: E402

pytestmark = pytest.mark.net


def test_api_key_over_tls_against_the_router(redis_url, tmp_path):
    cert, key = self_signed_cert()
    (tmp_path / "cert.pem").write_bytes(cert)
    (tmp_path / "key.pem").write_bytes(key)
    tls = TlsFiles(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"))

    async def main():
        async with router_stack(redis_url, [FakePrefill("p0")], [FakeDecode("d0")]) as s:
            frontend = await start_grpc_server(
                s.orchestrator, s.models, s.tokenizer, api_keys=ApiKeys(["k-1"]), tls=tls
            )
            target = f"127.0.0.1:{frontend.port}"
            try:
                async with AsyncClient(target, api_key="k-1", tls=str(tmp_path / "cert.pem")) as client:
                    result = await client.generate(prompt_ids=[1, 2, 3], max_tokens=3).final()
                    assert len(result.output_ids) == 3
                async with AsyncClient(target, api_key="wrong", tls=str(tmp_path / "cert.pem")) as client:
                    with pytest.raises(Unauthenticated):
                        await client.generate(prompt_ids=[1, 2, 3], max_tokens=3).final()
            finally:
                await frontend.stop(grace_s=None)

    asyncio.run(asyncio.wait_for(main(), 60))
