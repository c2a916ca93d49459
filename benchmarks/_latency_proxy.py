"""An HTTP proxy on 127.0.0.1 that holds every request for a fixed delay before passing it
to a local S3 server: what a store in another region (or a busy one) costs per round trip,
so the scale harness measures request counts the way they matter.

``LatencyProxy`` runs it in a process of its own (this file as a script), so forwarding
is not charged to the process under measurement; ``GET /__requests__`` tells the count."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}


COUNT_PATH = "/__requests__"


class LatencyProxy:
    """The proxy in a child process, for a ``with`` block; ``requests`` counts what it forwarded."""

    def __init__(self, upstream: str, delay: float = 0.020):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._args = [sys.executable, __file__, upstream, str(delay), str(self.port)]
        self._process: subprocess.Popen | None = None

    @property
    def requests(self) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", COUNT_PATH)
            return int(json.loads(conn.getresponse().read())["requests"])
        finally:
            conn.close()

    def __enter__(self) -> LatencyProxy:
        self._process = subprocess.Popen(self._args)
        for _ in range(300):
            try:
                if self.requests == 0:
                    return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"the latency proxy did not start on {self.url}")

    def __exit__(self, *exc) -> None:
        assert self._process is not None
        self._process.terminate()
        self._process.wait()


class _Proxy:
    def __init__(self, upstream: str, delay: float, port: int):
        target = urlparse(upstream)
        local = threading.local()
        counter = {"requests": 0}
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _forward(self) -> None:
                if self.path == COUNT_PATH:
                    payload = json.dumps(counter).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
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

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True


if __name__ == "__main__":
    _Proxy(sys.argv[1], float(sys.argv[2]), int(sys.argv[3])).server.serve_forever()
