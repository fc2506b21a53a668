"""Opt-in authentication and encryption of the side channel with ZMQ CURVE.

Anyone who reaches an unauthenticated handshake port can read where every KV block lives
and can publish metadata in an engine's name. With CURVE, every handshake and publish
connection is encrypted, a client must know the server's public key, and a server admits
only clients whose public key it holds.

Keys are ZMQ certificate files in one directory (a Kubernetes Secret mounted as a volume),
made by `kvrdma keygen DIR`:

| file | holds | needed by |
|---|---|---|
| `server.key_secret` | the servers' key pair | handshake servers and sidecars |
| `server.key` | the servers' public key | every client |
| `client.key_secret` | the clients' key pair | handshake clients and publishers |
| `*.key` | public keys of clients a server admits | servers |

Every peer of a deployment mounts the same directory; a client key can be revoked by
removing its `.key` file from the servers' copy (read at start-up).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from kvrdma.errors import ConfigError
from kvrdma.log_limit import RateLimitedLog

logger = logging.getLogger(__name__)

ENV_CURVE_DIR = "KVRDMA_CURVE_DIR"
SERVER_CERT = "server.key_secret"
SERVER_PUBLIC = "server.key"
CLIENT_CERT = "client.key_secret"
CLIENT_PUBLIC = "client.key"
_REFUSED_LOG_INTERVAL_S = 10.0  # a client retrying with a wrong key must not flood the log
# security handshakes that failed: no or wrong CURVE keys, or a key the gate refused
_AUTH_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


@dataclass(frozen=True)
class CurveKeys:
    """The CURVE keys one process uses, loaded from a key directory."""

    directory: str
    server_public: bytes
    client_public: bytes
    client_secret: bytes
    server_secret: bytes | None = None  # only where a server runs
    authorized: frozenset[bytes] = frozenset()  # client public keys a server admits

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> CurveKeys:
        """Read the key directory; errors name the file that is missing or unreadable."""
        path = Path(directory)
        if not path.is_dir():
            raise ConfigError(
                f"curve key directory {str(path)!r} does not exist (make one with "
                f"'kvrdma keygen {path}')"
            )
        server_public, _ = _certificate(path / SERVER_PUBLIC)
        client_public, client_secret = _certificate(path / CLIENT_CERT)
        if client_secret is None:
            raise ConfigError(f"curve key file {str(path / CLIENT_CERT)!r} holds no secret key")
        server_secret = None
        if (path / SERVER_CERT).exists():
            public, server_secret = _certificate(path / SERVER_CERT)
            if public != server_public:
                raise ConfigError(
                    f"curve keys in {str(path)!r}: {SERVER_CERT} and {SERVER_PUBLIC} are not "
                    "the same key pair"
                )
        authorized = frozenset(_certificate(p)[0] for p in sorted(path.glob("*.key")))
        return cls(
            directory=str(path),
            server_public=server_public,
            client_public=client_public,
            client_secret=client_secret,
            server_secret=server_secret,
            authorized=authorized,
        )

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> CurveKeys | None:
        """Keys from `$KVRDMA_CURVE_DIR`, or None when it is unset or empty."""
        directory = (environ if environ is not None else os.environ).get(ENV_CURVE_DIR, "")
        return cls.load(directory) if directory else None


def _certificate(path: Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"curve key file {str(path)!r} cannot be read: {exc}") from exc
    return public, secret


def generate_keys(directory: str | os.PathLike[str], *, overwrite: bool = False) -> list[Path]:
    """Write a server and a client key pair into `directory` (created, mode 0700); returns
    the files written. Refuses to replace existing keys unless `overwrite`."""
    path = Path(directory)
    names = (SERVER_CERT, SERVER_PUBLIC, CLIENT_CERT, CLIENT_PUBLIC)
    existing = [n for n in names if (path / n).exists()]
    if existing and not overwrite:
        raise ConfigError(
            f"curve keys already exist in {str(path)!r} ({', '.join(existing)}); "
            "pass --force to replace them"
        )
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    written: list[Path] = []
    for name in ("server", "client"):
        public, secret = zmq.auth.create_certificates(path, name)
        Path(secret).chmod(0o600)
        written += [Path(public), Path(secret)]
    return written


def secure_server(sock: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Make `sock` a CURVE server (call before bind)."""
    if keys.server_secret is None:
        raise ConfigError(
            f"curve key directory {keys.directory!r} has no {SERVER_CERT}: a server needs "
            "the servers' secret key"
        )
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True


def secure_client(sock: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Make `sock` a CURVE client of the servers' key (call before connect)."""
    sock.curve_secretkey = keys.client_secret
    sock.curve_publickey = keys.client_public
    sock.curve_serverkey = keys.server_public


class CurveGate:
    """Admits clients whose public key is authorized on every CURVE server socket of one ZMQ
    context. One per context; `stop()` ends it."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], keys: CurveKeys) -> None:
        self._authorized = keys.authorized
        self._refused = RateLimitedLog(logger, logging.WARNING, _REFUSED_LOG_INTERVAL_S)
        self._auth = ThreadAuthenticator(context, log=logging.getLogger(f"{__name__}.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP's question for one connecting client: is its public key authorized?"""
        if key in self._authorized:
            return True
        self._refused.occurred("side channel: refused a client with an unknown CURVE key")
        return False

    def stop(self) -> None:
        self._auth.stop()


def refusal_monitor(sock: zmq.Socket[bytes], events: int = 0) -> zmq.Socket[bytes]:
    """A socket reporting each client whose security handshake with `sock` failed, and the
    other `events` (libzmq allows one monitor per socket)."""
    return sock.get_monitor_socket(_AUTH_FAILURES | events)


def refused_clients(
    monitor: zmq.Socket[bytes], others: Callable[[int, int], None] | None = None
) -> list[str]:
    """The endpoints of the clients `monitor` reported as refused since the last call; every
    other event goes to `others(event, value)`."""
    refused: list[str] = []
    while True:
        try:
            event = recv_monitor_message(monitor, zmq.NOBLOCK)
        except zmq.Again:
            return refused
        if event["event"] & _AUTH_FAILURES:
            refused.append(str(event["endpoint"]))
        elif others is not None:
            others(int(event["event"]), int(event["value"]))
