"""The HTTP proxy that answers a store's errors (psguard.chaos.http_faults) as the chaos harness runs it: agents
and trainers killed mid-request hang up on it, which is their business, not an error of the proxy."""

from __future__ import annotations

import http.client
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from psguard.chaos.http_faults import HttpErrorProxy, error_code


class _Upstream:
    """A store that answers every GET with 64 KB once ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.asked = threading.Event()
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_: Any) -> None:
                pass

            def do_GET(self) -> None:
                upstream.asked.set()
                upstream.release.wait(30)
                body = b"x" * (64 << 10)
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_HEAD(self) -> None:  # an object's size, as S3's HeadObject answers it: no body
                self.send_response(200)
                self.send_header("Content-Length", str(64 << 10))
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def test_a_client_that_hangs_up_mid_request_is_not_an_error_of_the_proxy(capsys: pytest.CaptureFixture[str]) -> None:
    """A chaos run of a GCS case with store-errors printed 478 tracebacks (BrokenPipeError, ConnectionResetError)
    to the run's output: every request an agent or trainer gave up on (killed by the nemesis, or done waiting)."""
    upstream = _Upstream()
    try:
        with HttpErrorProxy(upstream.url, dialect="gcs") as proxy:
            host, port = proxy.endpoint_url.removeprefix("http://").split(":")
            for _ in range(3):
                upstream.asked.clear()
                upstream.release.clear()
                client = socket.create_connection((host, int(port)), timeout=10)
                client.sendall(b"GET /storage/v1/b/x/o/y?alt=media HTTP/1.1\r\nHost: x\r\n\r\n")
                assert upstream.asked.wait(30)  # forwarded: the proxy waits for the store's answer
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()  # a reset: the client is gone before its answer
                upstream.release.set()
            proxy.heal()
        assert proxy.forwarded == 3  # every answer came, and went to a client that had left
    finally:
        upstream.close()
    assert "Traceback" not in capsys.readouterr().err


def test_a_head_request_keeps_the_stores_content_length() -> None:
    """S3's HeadObject says an object's size in Content-Length, with no body; the proxy answered every HEAD with
    ``Content-Length: 0`` (the body it had read), so through it every S3 object was 0 bytes long (s3fs's info())."""
    upstream = _Upstream()
    try:
        with HttpErrorProxy(upstream.url) as proxy:
            host, port = proxy.endpoint_url.removeprefix("http://").split(":")
            conn = http.client.HTTPConnection(host, int(port), timeout=10)
            conn.request("HEAD", "/bucket/key")
            answer = conn.getresponse()
            assert (answer.status, answer.getheader("Content-Length"), answer.read()) == (200, str(64 << 10), b"")
            conn.close()
    finally:
        upstream.close()


def test_an_error_answer_to_a_head_has_no_body_so_the_next_answer_on_the_connection_parses() -> None:
    """The error proxy wrote its XML after a HEAD's 500: aiohttp (s3fs's client) parses a keep-alive connection as
    one stream, so its next request on it read that XML as the status line ("Bad status line", an HTTPClientError
    that is not retried), and test_store_errors_come_from_a_proxy_in_front_of_the_one_the_network_faults_use[s3]
    failed under CI's load. Read here as a stream: a HEAD and a GET sent together on one connection."""
    upstream = _Upstream()
    try:
        with HttpErrorProxy(upstream.url) as proxy:
            proxy.fail_all(500)
            host, port = proxy.endpoint_url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                asks = [f"{verb} /bucket/key HTTP/1.1\r\nHost: {host}\r\n\r\n" for verb in ("HEAD", "GET")]
                sock.sendall("".join(asks).encode())
                stream = sock.makefile("rb")
                head = _headers(stream)
                assert head[0].startswith(b"HTTP/1.1 500")
                answer = _headers(stream)  # the next bytes on the stream: the GET's status line, no HEAD's body
                assert answer[0].startswith(b"HTTP/1.1 500"), answer[0]
                length = next(int(h.split(b":")[1]) for h in answer if h.lower().startswith(b"content-length"))
                assert b"<Code>InternalError</Code>" in stream.read(length)
    finally:
        upstream.close()


def _headers(stream: Any) -> list[bytes]:
    """An answer's status line and headers, read off ``stream`` up to the blank line."""
    lines = []
    while (line := stream.readline()) not in (b"\r\n", b""):
        lines.append(line)
    return lines


def test_each_dialect_answers_a_status_with_its_stores_error() -> None:
    assert (error_code("s3", 503), error_code("s3", 500), error_code("s3", 502)) == (
        "SlowDown", "InternalError", "InternalError"
    )  # fmt: skip
    assert (error_code("gcs", 503), error_code("gcs", 500), error_code("gcs", 504)) == (
        "backendError", "internalError", "backendError"
    )  # fmt: skip
