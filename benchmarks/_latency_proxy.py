"""An HTTP proxy on 127.0.0.1 that holds every request for a fixed delay before passing it
to a local S3 server: what a store in another region (or a busy one) costs per round trip,
so the scale harness measures request counts the way they matter."""

from __future__ import annotations

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}


class LatencyProxy:
    def __init__(self, upstream: str, delay: float = 0.020):
        target = urlparse(upstream)
        local = threading.local()
        counter = {"requests": 0}
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with lock:
                    counter["requests"] += 1
                time.sleep(delay)
                conn = getattr(local, "conn", None)
                if conn is None:
                    conn = local.conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                try:
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    response = conn.getresponse()
                    payload = response.read()
                except (http.client.HTTPException, OSError):
                    local.conn = None
                    raise
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self.counter = counter
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def requests(self) -> int:
        return self.counter["requests"]

    def __enter__(self) -> LatencyProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
