"""A fault-injecting HTTP reverse proxy on 127.0.0.1, for S3 tests in front of a moto server.

::

    proxy = FaultProxy(upstream="http://127.0.0.1:5000")
    proxy.add_rule(Rule("503", method="PUT", count=2))           # the next 2 PUTs get 503 SlowDown
    proxy.add_rule(Rule("reset", query="partNumber", count=1))   # reset one part upload
    proxy.add_rule(Rule("delay", method="GET", count=1, seconds=3))  # answer after 3 s (past a timeout)
    proxy.add_rule(Rule("slow", method="GET", count=1, seconds=0.5)) # dribble the body over 0.5 s
    proxy.add_rule(Rule("tarpit", count=None))                    # read the request, never answer
    proxy.add_rule(Rule("dribble", method="GET", count=None, seconds=1.5, chunk=2048))  # 2 KiB every 1.5 s
    proxy.add_rule(Rule("flip", method="GET", path="/data/"))        # one bit of one body flipped
    proxy.add_rule(Rule("412", method="PUT", path="/COMMIT"))        # refuse a write's precondition
    ... proxy.endpoint ...
    proxy.hits["503"], proxy.requests, proxy.close()

Each request goes to the first matching rule that has uses left (``count``; ``None``: forever);
a request no rule takes is forwarded as is. Rules match on method, a substring of the path and a
substring of the query string. Counters: ``requests`` (all), ``forwarded``, and ``hits[kind]``.
Every sleep is bounded by the rule's ``seconds`` (a tarpit's and a dribble's end when the client goes away
or the proxy is closed), and the server's threads are daemons.
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOWDOWN_XML = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>FAULTPROXY</RequestId></Error>"
)
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade", "trailer"}


@dataclass
class Rule:
    """One kind of fault: ``503`` (SlowDown), ``500`` (InternalError), ``reset`` (TCP RST before any
    response), ``delay`` (sleep ``seconds`` then forward), ``slow`` (forward, body dribbled over
    ``seconds``), ``tarpit`` (read the request, answer nothing until the proxy closes), ``dribble``
    (forward; the answer's headers at once, then ``chunk`` bytes of its body every ``seconds``), ``flip``
    (forward, one bit of the body's middle byte flipped: a corrupted download), ``412`` (PreconditionFailed,
    without forwarding: a store that refuses a conditional write)."""

    kind: str
    method: str | None = None
    path: str | None = None
    query: str | None = None
    count: int | None = 1
    seconds: float = 0.0
    chunk: int = 2048

    def matches(self, method: str, path: str, query: str) -> bool:
        return (
            (self.count is None or self.count > 0)
            and (self.method is None or self.method == method)
            and (self.path is None or self.path in path)
            and (self.query is None or self.query in query)
        )


class FaultProxy:
    """See the module docstring."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream_host = parts.hostname or "127.0.0.1"
        self.upstream_port = parts.port or 80
        self.rules: list[Rule] = []
        self.hits: Counter[str] = Counter()
        self.requests = 0
        self.forwarded = 0
        self.log: list[tuple[str, str, str]] = []  # (method, path?query, outcome)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        """Set by :meth:`close`: tarpits and dribbles stop."""
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _handle(self) -> None:
                proxy._serve(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self._thread.start()

    # -- configuration ------------------------------------------------------------------------------
    def add_rule(self, rule: Rule) -> Rule:
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    def reset_counters(self) -> None:
        with self._lock:
            self.hits.clear()
            self.requests = self.forwarded = 0
            self.log.clear()

    def close(self) -> None:
        self._closed.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    # -- serving -------------------------------------------------------------------------------------
    def _take(self, method: str, path: str, query: str) -> Rule | None:
        with self._lock:
            self.requests += 1
            for rule in self.rules:
                if rule.matches(method, path, query):
                    if rule.count is not None:
                        rule.count -= 1
                    self.hits[rule.kind] += 1
                    return rule
            return None

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        path, _, query = h.path.partition("?")
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        rule = self._take(h.command, path, query)
        outcome = rule.kind if rule else "forward"
        with self._lock:
            self.log.append((h.command, h.path, outcome))
        if rule is not None and rule.kind in ("503", "500", "412"):
            code, error = {"503": (503, b"SlowDown"), "500": (500, b"InternalError"),
                           "412": (412, b"PreconditionFailed")}[rule.kind]
            payload = SLOWDOWN_XML.replace(b"SlowDown", error)
            if rule.kind == "412":
                payload = payload.replace(b"Please reduce your request rate.",
                                          b"At least one of the pre-conditions you specified did not hold")
            h.send_response(code)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(payload)))
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(payload)
            return
        if rule is not None and rule.kind == "reset":
            sock = h.connection
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            h.close_connection = True
            sock.close()  # RST: the client sees a connection reset
            return
        if rule is not None and rule.kind == "tarpit":
            self._closed.wait()  # the connection stays open, silent, until the proxy closes
            h.close_connection = True
            return
        if rule is not None and rule.kind == "delay":
            time.sleep(rule.seconds)
        status, headers, data = self._forward(h.command, h.path, h.headers.items(), body)
        try:
            h.send_response(status)
            for name, value in headers:
                if name.lower() not in _HOP and name.lower() != "content-length":
                    h.send_header(name, value)
            declared = dict((k.lower(), v) for k, v in headers).get("content-length")
            h.send_header("Content-Length", declared if h.command == "HEAD" and declared else str(len(data)))
            h.end_headers()
            if h.command == "HEAD" or not data:
                return
            if rule is not None and rule.kind == "flip":
                data = data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0x10]) + data[len(data) // 2 + 1 :]
            if rule is not None and rule.kind == "dribble":
                for i in range(0, len(data), rule.chunk):
                    h.wfile.write(data[i : i + rule.chunk])
                    h.wfile.flush()
                    if self._closed.wait(rule.seconds):
                        break
            elif rule is not None and rule.kind == "slow":
                pieces = 10
                step = max(1, -(-len(data) // pieces))
                for i in range(0, len(data), step):
                    h.wfile.write(data[i : i + step])
                    h.wfile.flush()
                    time.sleep(rule.seconds / pieces)
            else:
                h.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError, OSError):
            h.close_connection = True  # the client gave up (e.g. timed out on a delay)

    def _forward(self, method: str, target: str, headers: list[tuple[str, str]], body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(self.upstream_host, self.upstream_port, timeout=60)
        try:
            conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for name, value in headers:
                if name.lower() in _HOP or name.lower() in ("content-length", "expect"):
                    continue
                conn.putheader(name, value)
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            resp = conn.getresponse()
            data = resp.read()
            with self._lock:
                self.forwarded += 1
            return resp.status, resp.getheaders(), data
        finally:
            conn.close()
