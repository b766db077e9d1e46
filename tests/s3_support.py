"""A real S3 server for tests (moto's, on 127.0.0.1) and a fault-injecting proxy.

The proxy forwards HTTP requests to the server and, for a share of them, answers
503 SlowDown instead or drops the connection without answering: what a busy object
store does. It can also cut the first answers' bodies short (a connection reset while
an object's bytes arrive). Both listen on loopback only, on free ports, and stop with the test run.
"""

from __future__ import annotations

import http.client
import random
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from shardstore.stores.s3 import S3Options
from shardstore.testing import LocalS3Server

KEY, SECRET, REGION = "testing-key", "testing-secret", "us-east-1"


def s3_options(endpoint: str, **kw) -> S3Options:
    """Options for the test server (or a proxy in front of it) at ``endpoint``."""
    return S3Options(endpoint_url=endpoint, key=KEY, secret=SECRET, region=REGION, **kw)


class MotoServer(LocalS3Server):
    """The test suite's S3 server (shardstore.testing), with the tests' credentials."""

    def __init__(self) -> None:
        super().__init__(KEY, SECRET, REGION)


@dataclass
class Faults:
    """What the proxy does to each request (probabilities, checked in this order)."""

    error_503: float = 0.0
    drop: float = 0.0
    seed: int = 0
    # the first this many answers with a body send half of it, then drop the connection
    cut_bodies: int = 0
    # (method, path) of requests answered 403 AccessDenied (what a policy refuses)
    forbidden: tuple[tuple[str, str], ...] = ()
    # (method, path) of requests forwarded whose answer is lost (the connection dropped)
    lose_replies: tuple[tuple[str, str], ...] = ()


class FaultyProxy:
    """HTTP proxy in front of ``target_port`` that injects ``faults``."""

    def __init__(self, target_port: int, faults: Faults) -> None:
        self.target_port, self.faults = target_port, faults
        self.counts = {"forwarded": 0, "503": 0, "dropped": 0, "cut": 0}
        self.bytes_received = 0  # request bodies from the clients (what they uploaded)
        self.bytes_sent = 0  # answer bodies to the clients (what they downloaded), cut ones included
        self.seen: list[tuple[str, str]] = []  # (method, path) of every request, in order of arrival
        self._lock = threading.Lock()
        self._random = random.Random(faults.seed)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _handle(self) -> None:
                body = self._read_body()
                with proxy._lock:
                    proxy.bytes_received += len(body)
                    proxy.seen.append((self.command, self.path))
                if (self.command, self.path) in proxy.faults.forbidden:
                    self._answer(403, b"<Error><Code>AccessDenied</Code><Message>injected</Message></Error>")
                    return
                fate = proxy._fate()
                if fate == "503":
                    self._answer(503, b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>")
                    return
                if fate == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self._forward(body)

            def _answer(self, status: int, payload: bytes) -> None:
                """An error of the server's own: ``payload`` (none to a HEAD)."""
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            def _read_body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    parts = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))

            def _forward(self, body: bytes) -> None:
                conn = http.client.HTTPConnection("127.0.0.1", proxy.target_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body if body or self.command in ("PUT", "POST") else None,
                             headers=headers)
                response = conn.getresponse()
                data = response.read()
                if (self.command, self.path) in proxy.faults.lose_replies:
                    conn.close()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.send_response(response.status, response.reason)
                for k, v in response.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(k, v)
                # a HEAD's answer has no body but the object's length
                self.send_header("Content-Length", response.getheader("Content-Length", "0")
                                 if self.command == "HEAD" else str(len(data)))
                self.end_headers()
                conn.close()
                if self.command == "HEAD":
                    return
                if data and proxy._cut_body():
                    with proxy._lock:
                        proxy.bytes_sent += len(data) // 2
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                with proxy._lock:
                    proxy.bytes_sent += len(data)
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _fate(self) -> str:
        with self._lock:
            r = self._random.random()
            if r < self.faults.error_503:
                fate = "503"
            elif r < self.faults.error_503 + self.faults.drop:
                fate = "dropped"
            else:
                fate = "forwarded"
            self.counts[fate] += 1
        return "drop" if fate == "dropped" else fate

    def _cut_body(self) -> bool:
        with self._lock:
            if self.counts["cut"] >= self.faults.cut_bodies:
                return False
            self.counts["cut"] += 1
        return True

    def start(self) -> FaultyProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
