"""Edge security options shared by the HTTP and gRPC frontends: API keys and TLS files.

API keys (optional): when any key is configured, every request must carry
`Authorization: Bearer <key>` (HTTP header; gRPC metadata `authorization`), else HTTP 401 in
OpenAI's error shape / gRPC UNAUTHENTICATED. `/health`, `/metrics`, the gRPC health service and
reflection stay open (probes and scrapers carry no key; neither reveals request data). Keys come
from an environment variable (comma-separated) or a file (one per line), never from the Serve
config, so they appear in no config dump; only their SHA-256 digests are kept, and `repr` shows
the count only, so a key never reaches a log.

TLS (optional): a PEM certificate chain and key; the gRPC server then listens with TLS only, and
the HTTP side is served by Serve's proxy with the same files (`http_options.ssl_certfile` /
`ssl_keyfile`, which `flashpd serve --tls-cert/--tls-key` sets).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable
from dataclasses import dataclass

from flashpd.services.api import Unauthenticated

DEFAULT_KEYS_ENV = "FLASHPD_API_KEYS"
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class ApiKeys:
    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(_digest(k.strip().encode()) for k in keys if k.strip())

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._digests)} keys)"

    def __len__(self) -> int:
        return len(self._digests)

    def allows(self, authorization: str | bytes | None) -> bool:
        """Does this `Authorization` value carry one of the keys (constant time per key)?"""
        if not self._digests:
            return True
        if authorization is None:
            return False
        raw = authorization.encode("latin-1", errors="replace") if isinstance(authorization, str) else authorization
        scheme, _, token = raw.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            return False
        digest = _digest(token.strip())
        return any(hmac.compare_digest(digest, d) for d in self._digests)

    def require(self, authorization: str | bytes | None) -> None:
        if not self.allows(authorization):
            raise Unauthenticated("missing or invalid API key (send Authorization: Bearer <key>)")

    @classmethod
    def load(
        cls, *, env_var: str | None = DEFAULT_KEYS_ENV, file: str | None = None, environ: dict[str, str] | None = None
    ) -> ApiKeys:
        """Keys from `env_var` (comma-separated) and `file` (one per line, `#` comments)."""
        env = os.environ if environ is None else environ
        keys: list[str] = []
        if env_var:
            keys += env.get(env_var, "").split(",")
        if file:
            with open(file, encoding="utf-8") as f:
                keys += [line for line in f.read().splitlines() if line.strip() and not line.lstrip().startswith("#")]
        return cls(keys)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


@dataclass(frozen=True)
class TlsFiles:
    cert_file: str  # PEM certificate chain
    key_file: str  # PEM private key

    def read(self) -> tuple[bytes, bytes]:
        """(key, certificate chain) as the gRPC server credentials want them."""
        with open(self.key_file, "rb") as k, open(self.cert_file, "rb") as c:
            return k.read(), c.read()

    @classmethod
    def from_paths(cls, cert_file: str | None, key_file: str | None) -> TlsFiles | None:
        if not cert_file and not key_file:
            return None
        if not (cert_file and key_file):
            raise ValueError("TLS needs both a certificate file and a key file")
        return cls(cert_file, key_file)
