"""The agent's HTTP endpoint: health for orchestrators, metrics for Prometheus, status and actions for people.

===========  =========  =====================================================================================
path         scope      answer
===========  =========  =====================================================================================
/healthz     none       200 while the agent process serves (liveness: restart the agent when this fails)
/readyz      none       200 when every readiness check passes, else 503; the body lists the checks
/metrics     read       the registry in Prometheus text format 0.0.4
/status      read       JSON from the agent's status callable
(POST)       control    POST handlers the agent registers (``/restart``, ``/failure``, ``/recovery`` ...)
===========  =========  =====================================================================================

``POST /restart`` kills a training task, so (docs/security.md has the threat model): every path but the open two
needs a bearer credential one of the :mod:`psguard.agent.control.auth` authenticators accepts, on loopback too
(``open_read`` serves the reads without one); with a CA in ``tls`` a client certificate too. Each connection has
one absolute deadline (``request_timeout``) for handshake, head and body, and :meth:`AgentHTTPServer.stop` cuts
every open one. Bad input is a 4xx, never a 500. Where reads are open on loopback, the ``Host`` header must name
loopback (DNS rebinding) and a POST must be JSON (a CORS preflight this server never approves). Credentials are
never logged; handlers never see ``Authorization``. Under load: :mod:`psguard.agent.control.connections`.
"""

from __future__ import annotations

import http.server
import io
import ipaddress
import json
import logging
import re
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from psguard.agent.control.auth import CONTROL, READ, SCOPES, Authenticator, TokenAuth
from psguard.agent.control.connections import Connection, Intake, answer_head, listen, target_path
from psguard.agent.control.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from psguard.agent.control.metrics import Registry
from psguard.errors import ConfigError, PsguardError

if TYPE_CHECKING:
    from typing import Self

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
BUILTIN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/status"})
_LENGTH = re.compile(r"[0-9]+")


class RequestError(PsguardError):
    """Raised by a handler for a bad request: answered with ``status`` and the message as JSON ``error``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Request:
    """What a registered handler gets. ``headers`` never include ``Authorization``."""

    method: str
    path: str
    query: Mapping[str, list[str]]
    headers: Mapping[str, str]
    body: bytes = b""

    def json(self) -> Any:
        """The body as JSON (``None`` for an empty body); a 400 for anything else, including ``NaN`` and
        ``Infinity`` (not JSON, and no count or time a handler takes) and nesting deeper than the parser goes."""
        if not self.body:
            return None
        try:
            return json.loads(self.body, parse_constant=_refuse_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(400, f"body is not valid JSON: {e}") from None
        except RecursionError:
            raise RequestError(400, "body is not valid JSON: nested too deeply") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


@runtime_checkable
class Pieces(Protocol):
    """A binary body written piece by piece, never joined (views of a big array: a peer copy's rows), then
    released (what keeps the views valid), sent or not."""

    parts: list[bytes | memoryview]

    def release(self) -> None: ...


@dataclass(frozen=True)
class Response:
    """``body``: JSON-able data (sent as JSON), ``str`` (text), ``bytes`` or :class:`Pieces`."""

    status: int = 200
    body: Any = None
    content_type: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)


Handler = Callable[[Request], "Response | Mapping[str, Any] | None"]
"""A handler returns a :class:`Response`, or JSON-able data for a 200, or ``None`` for ``{"ok": true}``."""


def is_loopback(host: str) -> bool:
    """True for ``127.0.0.0/8``, ``::1`` and ``localhost``: addresses only this machine can reach."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class _DeadlineReader(io.RawIOBase):
    """Socket reads that all end by one absolute deadline (a per-read timeout lets a byte every few seconds
    hold a connection forever), after the bytes the intake already read."""

    def __init__(self, sock: socket.socket, deadline: float, read: bytes | bytearray = b"") -> None:
        self._sock = sock
        self._deadline = deadline
        self._read = memoryview(bytes(read))

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._read:
            n = min(len(buffer), len(self._read))
            memoryview(buffer).cast("B")[:n] = self._read[:n]
            self._read = self._read[n:]
            return n
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the request did not arrive within its deadline")
        self._sock.settimeout(remaining)
        return self._sock.recv_into(buffer)


class AgentHTTPServer:
    """Serve the agent's endpoints from background threads until :meth:`stop`.

    ``readiness`` returns named checks (``{"task": True, "memory_tier": False}``); ready means all true.
    ``status`` returns JSON-able data. Both are called on request threads and must be thread-safe.
    ``port=0`` picks a free port; read it from :attr:`port` after :meth:`start`. ``workers`` threads answer the
    requests that pass the credential check, so at most that many handlers run at once.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        auth: Sequence[Authenticator] = (),
        open_read: bool = False,
        insecure_no_auth: bool = False,
        tls: ssl.SSLContext | None = None,
        registry: Registry | None = None,
        status: Callable[[], Mapping[str, Any]] | None = None,
        readiness: Callable[[], Mapping[str, bool]] | None = None,
        max_body: int = 1 << 20,
        request_timeout: float = 10.0,
        workers: int = 16,
    ) -> None:
        authenticators: list[Authenticator] = [TokenAuth(token)] if token is not None else []
        authenticators += auth
        if not authenticators:
            if not is_loopback(host):
                raise ConfigError(
                    f"refusing to serve the agent's HTTP endpoint on {host!r} without a token: anyone who can "
                    f"reach that address could restart tasks. Bind 127.0.0.1, or set a token (--token-file)"
                )
            if not insecure_no_auth:
                raise ConfigError(
                    "refusing to serve the agent's HTTP endpoint without a credential, even on loopback: every "
                    "local user could restart tasks. Give a token (--token-file; the agent makes one when none "
                    "is given) or JWT settings"
                )
        self.host = host
        self._requested_port = port
        self._auth = authenticators
        self.open_read = open_read
        self.tls = tls
        self._mutual_tls = tls is not None and tls.verify_mode != ssl.CERT_NONE
        self._registry = registry
        self._status = status
        self._readiness = readiness
        self.max_body = max_body
        self.request_timeout = request_timeout
        self.workers = workers
        self._lock = threading.Lock()
        self._post: dict[str, Handler] = {}
        self._binary_max: dict[str, int] = {}  # POST routes that take raw bytes, and their limit
        self._listener: socket.socket | None = None
        self.port = port  # the bound one once bind() ran (also after stop() closed the socket)
        self._intake: Intake | None = None
        self._closed = False

    def __repr__(self) -> str:  # no token in reprs either
        auth = ",".join(type(a).__name__ for a in self._auth) or "none"
        return f"AgentHTTPServer(host={self.host!r}, port={self.port}, auth={auth}, tls={self.tls is not None})"

    # ------------------------------------------------------------------------------------------ routes

    def add_post(self, path: str, handler: Handler, *, binary_max: int | None = None) -> None:
        """Serve ``POST path`` with ``handler`` (the ``control`` scope and a JSON content type required).

        ``binary_max``: the route also takes ``application/octet-stream`` bodies up to that many bytes (the
        peer copies' data between agents); JSON bodies keep the server's ``max_body``.
        """
        if not path.startswith("/") or "?" in path:
            raise ValueError(f"a route is a path starting with '/', got {path!r}")
        with self._lock:
            if path in self._post:
                raise ValueError(f"{path} already has a handler")
            self._post[path] = handler
            if binary_max is not None:
                self._binary_max[path] = binary_max

    # ------------------------------------------------------------------------------------------ lifecycle

    def bind(self) -> Self:
        """Listen on the address without answering yet: :attr:`url` is then known (to give a task before it
        starts) and a client that calls early waits in the listen queue until :meth:`start`."""
        with self._lock:
            if self._listener is not None:
                raise RuntimeError("the agent's HTTP server was already bound")
        try:
            listener = listen(self.host, self._requested_port)
        except OSError as e:
            raise PsguardError(
                f"cannot serve the agent's HTTP endpoint on {self.host}:{self._requested_port}: {e}"
            ) from e
        with self._lock:
            self._listener = listener
            self.port = int(listener.getsockname()[1])
        return self

    def start(self) -> Self:
        """Serve (binding first unless :meth:`bind` did)."""
        with self._lock:
            bound, started = self._listener is not None, self._intake is not None or self._closed
        if started:
            raise RuntimeError("the agent's HTTP server was already started")
        if not bound:
            self.bind()
        assert self._listener is not None
        intake = Intake(
            self._listener,
            lambda connection: _Handler(connection, self),
            screen=self._screen,
            health_paths=OPEN_PATHS,
            timeout=self.request_timeout,
            tls=self.tls,
            workers=self.workers,
            name=f"psguard-http-{self.port}",
        )
        with self._lock:
            self._intake = intake
        intake.start()
        log.info(
            "event=http_serving host=%s port=%d auth=%s tls=%s open_read=%s",
            self.host,
            self.port,
            ",".join(type(a).__name__ for a in self._auth) or "none",
            "mutual" if self._mutual_tls else bool(self.tls),
            self.open_read,
        )
        return self

    def _screen(self, connection: Connection) -> bytes | None:
        """On the intake's thread: a liveness probe, or a request refused on its head alone, answered without a
        worker (a flood of unauthenticated clients then costs the agent less than it costs them). Everything else
        goes to a worker, which checks again with its own parse of the head."""
        head = connection.head
        if head is None or head.path is None or head.method not in ("GET", "POST"):
            return None
        response = self._refusal(
            head.method,
            head.path,
            head.fields.get("host"),
            head.fields.get("authorization"),
            lambda: _has_client_certificate(connection.sock),
        )
        if response is None and head.method == "GET" and head.path == "/healthz":
            response = self._builtin(head.path)
        if response is None:
            return None
        data, content_type = _encoded(response)
        return answer_head(response.status, content_type, len(data), response.headers) + data

    def stop(self) -> None:
        """Stop accepting, cut open connections, wait for their threads, close the socket; re-raise a serving error.

        Not from a handler: it waits for every request thread, the caller's too. A ``/shutdown`` handler should
        set an event that the agent's main thread waits on.
        """
        with self._lock:
            listener, intake, closed = self._listener, self._intake, self._closed
            self._closed = True
        if listener is None or closed:
            return
        if intake is not None:
            intake.stop()  # a client sending a byte now and then must not hold a stopping agent
        listener.close()  # also a server bound and never started
        if intake is not None and intake.error is not None:
            raise intake.error

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        if host in ("0.0.0.0", "[::]", ""):
            host = "127.0.0.1"
        return f"{'https' if self.tls is not None else 'http'}://{host}:{self.port}"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------ for _Handler

    def _refusal(
        self, method: str, path: str, host: str | None, authorization: str | None, has_cert: Callable[[], bool]
    ) -> Response | None:
        """The answer to a request refused before any handler (foreign Host, no client certificate, no or a wrong
        credential, a missing scope); ``None`` when it may go on."""
        if not self._host_allowed(host):
            return Response(403, {"error": "Host header does not name a loopback address"})
        if path not in OPEN_PATHS and self._mutual_tls and not has_cert():
            return Response(403, {"error": "a client certificate signed by the agent's CA is required"})
        if path in OPEN_PATHS or (method != "POST" and self.open_read):
            return None
        required = CONTROL if method == "POST" else READ
        granted = self._scopes(authorization)
        if granted is None:
            return Response(
                401, {"error": "missing, wrong or expired bearer credential"}, headers={"WWW-Authenticate": "Bearer"}
            )
        if required not in granted:
            return Response(403, {"error": f"the credential lacks the {required!r} scope for {path}"})
        return None

    def _scopes(self, header: str | None) -> frozenset[str] | None:
        """The scopes the ``Authorization`` header's credential grants; ``None`` when none accepts it."""
        if not self._auth:
            return SCOPES  # insecure_no_auth, loopback only
        if not header:
            return None
        scheme, _, value = header.partition(" ")
        credential = value.strip()
        if scheme.lower() != "bearer" or not credential:
            return None
        for authenticator in self._auth:
            granted = authenticator.scopes(credential)
            if granted is not None:
                return granted
        return None

    def _host_allowed(self, header: str | None) -> bool:
        """Against DNS rebinding: where loopback serves something unauthenticated, the browser must believe it
        talks to loopback."""
        if (self._auth and not self.open_read) or not is_loopback(self.host) or not header:
            return True
        name = header.strip()
        if name.startswith("["):
            name = name[1 : name.find("]")] if "]" in name else name
        else:
            name = name.rsplit(":", 1)[0] if name.count(":") == 1 else name
        return is_loopback(name)

    def _builtin(self, path: str) -> Response | None:
        if path == "/healthz":
            return Response(200, {"status": "ok"})
        if path == "/readyz":
            if self._readiness is None:
                return Response(200, {"ready": True, "checks": {}})
            try:
                checks = {str(k): bool(v) for k, v in self._readiness().items()}
            except Exception as e:
                log.exception("event=readiness_failed")
                return Response(503, {"ready": False, "checks": {}, "error": f"{type(e).__name__}: {e}"})
            ready = all(checks.values())
            return Response(200 if ready else 503, {"ready": ready, "checks": checks})
        if path == "/metrics":
            return Response(200, self._registry.render() if self._registry is not None else "", METRICS_CONTENT_TYPE)
        if path == "/status":
            return Response(200, dict(self._status()) if self._status is not None else {})
        return None


def _encoded(response: Response) -> tuple[bytes, str]:
    """A body that is not :class:`Pieces` as bytes, and its content type."""
    body = response.body
    if isinstance(body, bytes):
        data, content_type = body, "application/octet-stream"
    elif isinstance(body, str):
        data, content_type = body.encode("utf-8"), "text/plain; charset=utf-8"
    else:
        data, content_type = (json.dumps(body, default=str) + "\n").encode("utf-8"), "application/json"
    return data, response.content_type or content_type


def _has_client_certificate(sock: socket.socket) -> bool:
    """True when the client presented a certificate (the handshake already verified it against the CA)."""
    return isinstance(sock, ssl.SSLSocket) and bool(sock.getpeercert())


class _ClientGone(ConnectionError):
    """The client's socket failed while its body was read: the client's doing, answered by no one."""


class _Handler(http.server.BaseHTTPRequestHandler):
    server_version = "psguard-agent"
    sys_version = ""
    disable_nagle_algorithm = True  # the head and the body are two writes: the body must not wait for an ACK

    def __init__(self, connection: Connection, agent: AgentHTTPServer) -> None:
        # What BaseRequestHandler.__init__ runs, for a connection the intake accepted and whose head it read.
        self.agent = agent
        self._accepted = connection
        self.request, self.client_address = connection.sock, connection.address
        self.setup()
        try:
            self.handle()
        finally:
            self.finish()

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.agent.request_timeout)  # for writing the answer
        self.rfile.close()
        # The head the intake read, then the body by the connection's one absolute deadline (set at accept).
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, self._accepted.deadline, self._accepted.data))

    # Sent outside _respond's error handling: a client that hung up is one DEBUG line, never a 500.
    def do_GET(self) -> None:
        self._send(self._respond("GET"))

    def do_POST(self) -> None:
        self._send(self._respond("POST"))

    def _respond(self, method: str) -> Response:
        agent = self.agent
        try:
            parts = urllib.parse.urlsplit(self.path)
        except ValueError:
            return Response(400, {"error": "the request target is not a URL path"})
        path = parts.path
        try:
            refusal = agent._refusal(
                method,
                path,
                self.headers.get("Host"),
                self.headers.get("Authorization"),
                lambda: _has_client_certificate(self.connection),
            )
            if refusal is not None:
                return refusal
            if method == "GET":
                return agent._builtin(path) or self._not_found(agent, path, method)
            handler = agent._post.get(path)
            if handler is None:
                return self._not_found(agent, path, method)
            body = self._read_body(agent.max_body, agent._binary_max.get(path))
            return self._call(handler, method, parts, body)
        except RequestError as e:
            return Response(e.status, {"error": str(e)})
        except _ClientGone:
            raise
        except Exception as e:
            log.exception("event=http_handler_failed method=%s path=%s", method, path)
            return Response(500, {"error": f"{type(e).__name__}: {e}"})

    @staticmethod
    def _not_found(agent: AgentHTTPServer, path: str, method: str) -> Response:
        other = agent._post if method == "GET" else BUILTIN_PATHS
        if path in other:
            return Response(405, {"error": f"{method} not allowed on {path}"})
        return Response(404, {"error": f"no such endpoint: {path}"})

    def _read_body(self, limit: int, binary_max: int | None = None) -> bytes:
        content_type = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if binary_max is not None and content_type == "application/octet-stream":
            limit = binary_max
        elif content_type != "application/json":
            raise RequestError(415, "POST bodies must be sent as Content-Type: application/json")
        # Decided on the header alone, before a byte of the body is read.
        lengths = {value.strip() for value in self.headers.get_all("Content-Length") or []}
        if not lengths:
            raise RequestError(411, "Content-Length is required")
        if len(lengths) > 1:
            raise RequestError(400, "conflicting Content-Length headers")
        (text,) = lengths
        if not _LENGTH.fullmatch(text):
            raise RequestError(400, "Content-Length must be a number of bytes (digits only)")
        if len(text) > 18 or int(text) > limit:
            raise RequestError(413, f"body larger than {limit} bytes")
        length = int(text)
        try:
            body = self.rfile.read(length)
        except TimeoutError:
            raise RequestError(
                408, f"the body ({length} bytes) did not arrive within the {self.agent.request_timeout:g} s deadline"
            ) from None
        except OSError as e:
            raise _ClientGone(f"reading the body: {type(e).__name__}") from None
        if len(body) < length:
            raise RequestError(400, f"the body ended after {len(body)} of the {length} bytes of its Content-Length")
        return body

    def _call(self, handler: Handler, method: str, parts: urllib.parse.SplitResult, body: bytes) -> Response:
        headers = {k: v for k, v in self.headers.items() if k.lower() != "authorization"}
        request = Request(method, parts.path, urllib.parse.parse_qs(parts.query), headers, body)
        result = handler(request)
        if isinstance(result, Response):
            return result
        return Response(200, {"ok": True} if result is None else dict(result))

    def _send(self, response: Response) -> None:
        body = response.body
        # Pieces last: an isinstance check against a runtime Protocol costs ~30 us, a tenth of a whole answer.
        if not isinstance(body, bytes | str | dict | list) and body is not None and isinstance(body, Pieces):
            try:
                self._send_parts(response, body.parts, response.content_type or "application/octet-stream")
            finally:
                body.release()
            return
        data, content_type = _encoded(response)
        self._send_parts(response, [data], content_type)

    def _send_parts(self, response: Response, parts: Sequence[bytes | memoryview], content_type: str) -> None:
        self.log_request(response.status)
        length = sum(memoryview(p).nbytes for p in parts)
        self.wfile.write(answer_head(response.status, content_type, length, response.headers))
        for part in parts:
            self.wfile.write(part)

    # The base class logs the raw request line to stderr; ours are structured and leave the query out.
    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        path = (target_path(self.path) if hasattr(self, "path") else None) or "-"
        command = getattr(self, "command", "-")
        log.debug(
            "event=http_request client=%s method=%s path=%s status=%s", self.client_address[0], command, path, code
        )

    def log_error(self, format: str, *args: Any) -> None:
        # The arguments can hold the raw request line; the template says enough.
        log.debug("event=http_error client=%s kind=%r", self.client_address[0], format)
