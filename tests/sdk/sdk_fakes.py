"""A scripted flashpd gRPC server for SDK tests: each Generate call plays the next step of a
script (fail, stream some tokens then break, finish), honouring resume_from_token."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from flashpd_sdk._gen import flashpd_pb2 as pb
from flashpd_sdk._gen import flashpd_pb2_grpc as pb_grpc

OUTPUT = b"hello world"
PREFILL_CREDIT = 128  # what every stream's first chunk reports


@dataclass(frozen=True)
class Step:
    """fail: a status code to end with; tokens: how many tokens to send first (None = all, then
    the final message); delay_s: pause before each token."""

    fail: grpc.StatusCode | None = None
    tokens: int | None = None
    delay_s: float = 0.0
    field: str | None = None


COMPLETE = Step()


@dataclass
class Servicer(pb_grpc.GenerationServicer):
    script: list[Step] = field(default_factory=list)
    requests: list[pb.GenerateRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)
    metadata: list[dict[str, str]] = field(default_factory=list)  # per call, any method

    def Generate(self, request, context):  # noqa: N802
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        step = self.script.pop(0) if self.script else COMPLETE
        context.add_callback(self.cancelled.set)
        # a continuation (continue_ids = tokens received) generates what follows those tokens
        offset = len(request.continue_ids.ids)
        start = offset + request.resume_from_token
        end = len(OUTPUT) if step.tokens is None else min(len(OUTPUT), start + step.tokens)
        for i in range(start, end):
            if step.delay_s:
                time.sleep(step.delay_s)
            if not context.is_active():
                return
            chunk = pb.TokenChunk(token_ids=[OUTPUT[i]], text=chr(OUTPUT[i]), index=i - offset)
            if i == offset:  # a stream's first chunk reports its prefill credit
                chunk.prefill_credit_tokens = PREFILL_CREDIT
            yield pb.GenerateResponse(chunk=chunk)
        if step.fail is not None:
            metadata = (("flashpd-field", step.field),) if step.field else None
            context.abort_with_status(_status(step.fail, f"scripted {step.fail.name}", metadata))
        yield pb.GenerateResponse(
            final=pb.Final(
                finish_reason=pb.FINISH_REASON_LENGTH,
                request_id=request.request_id,
                usage=pb.Usage(
                    prompt_tokens=3,
                    completion_tokens=len(OUTPUT),
                    cached_tokens=1,
                    cached_tokens_prefill=1,
                    cached_tokens_decode=2,
                ),
                timeline=pb.Timeline(route_ms=0.5, first_token_ms=3.0, e2e_ms=9.0),
                prefill_worker="p0",
                decode_worker="d0",
            )
        )

    def Abort(self, request, context):  # noqa: N802
        self.metadata.append(dict(context.invocation_metadata()))
        self.aborts.append(request.request_id)
        return pb.AbortResponse(found=True)

    def ListModels(self, request, context):  # noqa: N802
        return pb.ListModelsResponse(models=[pb.ModelCard(id="m", context_tokens=64, vocab_size=256)])


class _Status(grpc.Status):
    def __init__(self, code, details, trailing_metadata):
        self.code, self.details, self.trailing_metadata = code, details, trailing_metadata


def _status(code: grpc.StatusCode, details: str, metadata) -> grpc.Status:
    return _Status(code, details, metadata)


class ScriptedServer:
    def __init__(self, tls: tuple[bytes, bytes] | None = None) -> None:
        """`tls`: (certificate chain PEM, private key PEM) to serve TLS instead of plaintext."""
        self.servicer = Servicer()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_GenerationServicer_to_server(self.servicer, self._server)
        self.health = health.HealthServicer()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        if tls is None:
            self.port = self._server.add_insecure_port("127.0.0.1:0")
        else:
            creds = grpc.ssl_server_credentials([(tls[1], tls[0])])
            self.port = self._server.add_secure_port("127.0.0.1:0", creds)
        self.target = f"127.0.0.1:{self.port}"

    @property
    def metadata(self) -> list[dict[str, str]]:
        return self.servicer.metadata

    def play(self, *steps: Step) -> None:
        self.servicer.script = list(steps)

    @property
    def requests(self) -> list[pb.GenerateRequest]:
        return self.servicer.requests

    def __enter__(self) -> ScriptedServer:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(None)


def self_signed_cert(host: str = "127.0.0.1") -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) for `host` (an IP SAN), valid for a day."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem
