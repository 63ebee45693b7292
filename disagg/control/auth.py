"""Who may talk to a job's control plane: a per-job token, and optional TLS.

At start the driver generates a random token and writes it to
``<run_dir>/control.token`` with mode 0600; every gRPC call (engines, trainer,
``disagg ctl``, the user's own tooling) sends it as ``authorization: Bearer
<token>`` metadata, and the server answers ``UNAUTHENTICATED`` without it.
With ``control.tls_cert`` / ``control.tls_key`` the server speaks TLS and
clients verify it against ``control.tls_ca`` (default: the certificate itself,
for a self-signed one).
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

import grpc

from disagg.errors import ControlError

TOKEN_FILE = "control.token"
METADATA_KEY = "authorization"


def write_token(run_dir: Path) -> tuple[str, Path]:
    """A fresh token in ``run_dir/control.token`` (mode 0600, replacing any older one)."""
    token = secrets.token_urlsafe(32)
    path = Path(run_dir) / TOKEN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{TOKEN_FILE}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask cannot widen it; an existing file keeps no old mode
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return token, path


def read_token(path: str | Path) -> str:
    """The token in ``path``; a ControlError names the file when it is missing, empty or readable by others."""
    p = Path(os.path.expanduser(str(path)))
    try:
        mode = p.stat().st_mode & 0o777
        token = p.read_text().strip()
    except OSError as e:
        raise ControlError(f"cannot read the control token file {p}: {e.strerror}") from None
    if not token:
        raise ControlError(f"control token file {p} is empty")
    if mode & 0o077:
        raise ControlError(f"control token file {p} has mode {mode:o}; it must be readable by its owner only "
                           f"(chmod 600 {p})")
    return token


def api_key(spec: str | None, token: str | None) -> str | None:
    """The key the engines' OpenAI endpoints ask off loopback (``rollout.api_key``): ``token`` (the
    job's control token) for null, the driver's environment variable NAME for 'env:NAME', the file
    PATH (owner-only, like the token's) for 'file:PATH'. A ConfigError names the key and what is missing."""
    from disagg.errors import ConfigError

    if spec is None:
        return token
    kind, _, where = spec.partition(":")
    if kind == "env":
        key = os.environ.get(where, "").strip()
        if not key:
            raise ConfigError(f"rollout.api_key={spec!r}: the environment variable {where} is unset or empty here")
        return key
    try:
        return read_token(where)
    except ControlError as e:
        raise ConfigError(f"rollout.api_key={spec!r}: {e}") from None


def bearer(token: str) -> tuple[tuple[str, str]]:
    """Call metadata carrying ``token``."""
    return ((METADATA_KEY, f"Bearer {token}"),)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose metadata lacks ``authorization: Bearer <token>`` (constant-time compare)."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("TokenAuthInterceptor needs a non-empty token")
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        metadata = dict(handler_call_details.invocation_metadata or ())
        got = metadata.get(METADATA_KEY, "")
        if isinstance(got, str) and hmac.compare_digest(got.encode(), self._expected):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED
            return None
        why = ("no control token: send 'authorization: Bearer <token>' metadata (the token is in the run "
               f"directory's {TOKEN_FILE}; `disagg ctl --token-file`)") if not got else "wrong control token"

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

        if handler.response_streaming:
            def deny_stream(request, context):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
                yield  # pragma: no cover - abort raises

            return grpc.unary_stream_rpc_method_handler(deny_stream, handler.request_deserializer,
                                                        handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)


def server_credentials(cert: str, key: str) -> grpc.ServerCredentials:
    """TLS credentials from PEM files; a ControlError names the file that cannot be read."""
    return grpc.ssl_server_credentials([(_read_pem(key, "control.tls_key"), _read_pem(cert, "control.tls_cert"))])


def channel_credentials(ca: str) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=_read_pem(ca, "control.tls_ca"))


def _read_pem(path: str, key: str) -> bytes:
    p = Path(os.path.expanduser(path))
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ControlError(f"{key}={path!r}: cannot read: {e.strerror}") from None
    if b"-----BEGIN" not in data:
        raise ControlError(f"{key}={path!r}: not a PEM file")
    return data
