"""An HTTP proxy in front of an object store that answers some requests with the store's error responses.

Object stores fail in ways a TCP proxy cannot show: an ``InternalError`` (500) right after a restart, or
``SlowDown`` / ``ServiceUnavailable`` (503) under load, and GCS's ``rateLimitExceeded`` (429). Every client must
retry those; this proxy makes them happen on demand. Requests are forwarded as they came (method, path, headers,
body), so SigV4 signatures made for the proxy's address stay valid: the upstream checks them against the ``Host``
header the client sent.

``fail_next(n, status=503, code="SlowDown")`` answers the next ``n`` requests with that error instead of
forwarding them, as an S3 XML error document or (``dialect="gcs"``) a GCS JSON one, whose ``reason`` is ``code``;
``fail_all(status)`` answers every request so until :meth:`heal` (the chaos harness's ``store-errors`` fault);
:attr:`failed` counts the error answers given. :meth:`close` stops the server and joins its threads.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal
from urllib.parse import urlsplit

__all__ = ["HttpErrorProxy", "error_code"]

_MESSAGES = {
    "SlowDown": "Please reduce your request rate.",
    "ServiceUnavailable": "Service is unable to handle request.",
    "InternalError": "We encountered an internal error, please try again.",
    "rateLimitExceeded": "The project exceeded the rate limit for CloudStorage and this operation.",
    "backendError": "Backend Error",
    "internalError": "Internal Error",
    "forbidden": "The caller does not have storage.objects.get access to the Google Cloud Storage object.",
}


#: The error each dialect answers a status with by default: S3's code, GCS's reason.
_CODES = {
    "s3": {500: "InternalError", 503: "SlowDown"},
    "gcs": {429: "rateLimitExceeded", 500: "internalError", 503: "backendError"},
}


def error_code(dialect: Literal["s3", "gcs"], status: int) -> str:
    """The error ``dialect``'s store answers ``status`` with (S3: ``InternalError`` for any 5xx but 503's
    ``SlowDown``; GCS: ``backendError`` for any 5xx but 500's ``internalError``)."""
    fallback = "backendError" if dialect == "gcs" else "InternalError"
    return _CODES[dialect].get(status, fallback)


def error_document(dialect: Literal["s3", "gcs"], status: int, code: str) -> tuple[str, bytes]:
    """The content type and body a store answers an error with: S3's XML ``<Error>``, GCS's JSON ``error``."""
    message = _MESSAGES.get(code, code)
    if dialect == "gcs":
        error = {
            "code": status,
            "message": message,
            "errors": [{"domain": "global", "reason": code, "message": message}],
        }
        return "application/json; charset=UTF-8", json.dumps({"error": error}).encode()
    doc = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>{message}</Message><RequestId>psguard-chaos</RequestId></Error>"
    )
    return "application/xml", doc.encode()


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up before its answer (an agent the nemesis killed, a request given up on) is its own
        business; anything else is printed as socketserver does."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class HttpErrorProxy:
    """Listens on ``127.0.0.1`` (a free port: :attr:`endpoint_url`) and forwards to ``upstream``; its error answers
    are in ``dialect``'s form."""

    def __init__(self, upstream: str, *, dialect: Literal["s3", "gcs"] = "s3") -> None:
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._lock = threading.Lock()
        self._pending: list[tuple[int, str]] = []
        self._always: tuple[int, str] | None = None  # fail_all's answer, until heal()
        self.dialect = dialect
        self._connections: set[socket.socket] = set()  # open client connections, ended by close()
        self.failed = 0
        self.forwarded = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_: Any) -> None:  # quiet: the test asserts on counts
                pass

            def setup(self) -> None:
                super().setup()
                with proxy._lock:
                    proxy._connections.add(self.connection)

            def finish(self) -> None:
                with proxy._lock:
                    proxy._connections.discard(self.connection)
                super().finish()

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                fault = proxy._take_fault()
                if fault is not None:
                    status, code = fault
                    content_type, doc = error_document(dialect, status, code)
                    self.send_response(status)
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(len(doc)))
                    self.end_headers()
                    if self.command != "HEAD":  # a HEAD's error has no body: the client reads the next answer next
                        self.wfile.write(doc)
                    return
                conn = http.client.HTTPConnection(*proxy._upstream, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                    conn.request(self.command, self.path, body=body if length else None, headers=headers)
                    response = conn.getresponse()
                    data = response.read()
                finally:
                    conn.close()
                with proxy._lock:
                    proxy.forwarded += 1
                self.send_response(response.status, response.reason)
                for key, value in response.getheaders():
                    if key.lower() not in ("connection", "transfer-encoding", "content-length"):
                        self.send_header(key, value)
                # A HEAD's answer has no body, and its Content-Length is the object's size (S3's HeadObject).
                size = response.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", size if size is not None else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = False
        self._server.block_on_close = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="chaos-http-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint_url(self) -> str:
        port = self._server.server_address[1]
        return f"http://127.0.0.1:{port}"

    def fail_next(self, n: int, *, status: int = 503, code: str = "SlowDown") -> None:
        """Answer the next ``n`` requests with ``status`` and the error ``code`` (S3's code, GCS's reason), not
        forwarded."""
        with self._lock:
            self._pending.extend([(status, code)] * n)

    def fail_all(self, status: int = 503, code: str | None = None) -> None:
        """Answer every request with ``status`` (and ``code``, by default the dialect's: :func:`error_code`), not
        forwarded, until :meth:`heal`."""
        with self._lock:
            self._always = (status, code or error_code(self.dialect, status))

    def heal(self) -> None:
        """Forward every request again (drops the error answers not given yet)."""
        with self._lock:
            self._pending.clear()
            self._always = None

    def _take_fault(self) -> tuple[int, str] | None:
        with self._lock:
            if not self._pending and self._always is None:
                return None
            self.failed += 1
            return self._pending.pop(0) if self._pending else self._always

    def close(self) -> None:
        self._server.shutdown()
        # A client's idle keep-alive connection holds its handler thread until the client closes it (its pool
        # can keep it for many seconds): end every open connection, so server_close() joins at once.
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> HttpErrorProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
