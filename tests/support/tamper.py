"""An HTTP proxy in front of one agent that can damage the rows of the peer copy it serves.

It stands for a holder whose copy went bad in memory (a bit flipped, a bug): each frame of rows it answers to
``POST /peer-copy/read`` is decoded, one value changed and encoded again, so the frame itself is well formed
(its CRC matches) and only the owner's digests can tell. Everything else is passed through unchanged.
"""

from __future__ import annotations

import http.client
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from psguard.agent.tiers.copy_frames import decode_frame, encode_frame

__all__ = ["CopyTamperProxy"]


class CopyTamperProxy:
    """``url`` forwards to ``upstream``; after :meth:`arm`, rows read from a peer copy come back damaged."""

    def __init__(self, upstream: str) -> None:
        parts = urllib.parse.urlsplit(upstream)
        target = (parts.hostname or "127.0.0.1", int(parts.port or 80))
        self.armed = threading.Event()
        self.damaged = 0  # frames of rows damaged
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn = http.client.HTTPConnection(*target, timeout=120)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    response = conn.getresponse()
                    data, status, kind = response.read(), response.status, response.getheader("Content-Type")
                finally:
                    conn.close()
                if proxy.armed.is_set() and self.path == "/peer-copy/read" and status == 200:
                    data = proxy._damage(data)
                self.send_response(status)
                self.send_header("Content-Type", kind or "application/octet-stream")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="copy-tamper", daemon=True)
        self._thread.start()

    def arm(self) -> None:
        self.armed.set()

    def _damage(self, frame: bytes) -> bytes:
        header, arrays = decode_frame(frame)
        if not arrays or arrays[0].size == 0:
            return frame  # the copy's description (layout, digests): left as the holder sent it
        header.pop("arrays", None)
        header.pop("crc32", None)
        bad = arrays[0].copy()
        flat = bad.reshape(-1).view(np.uint8)
        flat[0] ^= 0x01
        self.damaged += 1
        return encode_frame(header, [bad, *arrays[1:]])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)
