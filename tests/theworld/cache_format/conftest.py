"""Shared by the object-storage tests of this folder: one real S3 server (moto's server mode) on 127.0.0.1 for the
session, behind a small HTTP proxy of the tests' own that logs every request and can hold, fail or cut requests."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import re
import shutil
import socket
import struct
import threading
import time
from hashlib import sha256
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.conftest import free_port
from theworld import cache_format as cf
from theworld.cache_format.names import SHARD_INDEX

BUCKET = "theworld-test"


class Proxy:
    """Forwards HTTP to `port`, logging (method, path) of each request; `hold(regex)` stops the first matching
    request's forwarding (the client sees no answer) until `release()`."""

    def __init__(self, port: int):
        self.port, self.log, self.rule, self.fail, self.faults = port, [], None, None, []
        self.held, self.released = threading.Event(), threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def forward(self):
                body = self._body()
                # (method, path, Range header): a shard's download asks from byte 0, a sample's text from within
                proxy.log.append((self.command, self.path.split("?")[0], self.headers.get("Range")))
                if proxy.fail and proxy.fail[0] == self.command and re.search(proxy.fail[1], self.path):
                    if proxy.fail[2] > 0:
                        proxy.fail = (*proxy.fail[:2], proxy.fail[2] - 1)
                        self.send_response(500)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                if proxy.rule and proxy.rule[0] == self.command and re.search(proxy.rule[1], self.path):
                    proxy.rule = None
                    proxy.held.set()
                    proxy.released.wait(120)
                    self.close_connection = True
                    return
                fault = proxy._fault(self.command, self.path)
                if fault == "500":
                    self.send_response(500)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if fault == "slow":
                    time.sleep(0.3)
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "connection")
                }
                if body is not None:
                    headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=60)
                conn.request(self.command, self.path, body, headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                length = resp.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length or "0")
                self.end_headers()
                if fault in ("truncate", "reset") and len(data) > 1:
                    self.wfile.write(data[: len(data) // 2])  # the answer began, then the body stops short
                    self.wfile.flush()
                    if fault == "reset":  # RST instead of FIN
                        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    conn.close()
                    return
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            def _body(self) -> bytes | None:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while (n := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                        out += self.rfile.read(n)
                        self.rfile.readline()
                    self.rfile.readline()
                    return out
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else None

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def hold(self, method: str, pattern: str) -> None:
        self.held.clear(), self.released.clear()
        self.rule = (method, pattern)

    def fail_next(self, method: str, pattern: str, times: int) -> None:
        """Answer the next `times` matching requests with a 500 (a server in trouble)."""
        self.fail = (method, pattern, times)

    def release(self) -> None:
        self.released.set()

    def downloads(self, start: int, pattern: str) -> list[str]:
        """The paths matching `pattern` GET whole or from byte 0 since log entry `start`: the shards downloaded (a
        download asks for its first part from 0; reads of a sample's text ask for ranges within the tar)."""
        return [
            p
            for m, p, rng in self.log[start:]
            if m == "GET" and re.search(pattern, p) and (rng is None or rng.startswith("bytes=0-"))
        ]

    def inject(self, method: str, pattern: str, *faults: str) -> None:
        """The next matching requests, one fault each in turn: "500", "slow" (0.3 s), "truncate" (half the body,
        then the connection closes), "reset" (half the body, then a TCP reset). Adds to those not met yet, so
        faults can be given per object (concurrent downloads meet one pattern's faults in any order)."""
        self.faults += [(method, pattern, f) for f in faults]

    def _fault(self, method: str, path: str) -> str | None:
        for i, (m, pattern, fault) in enumerate(self.faults):
            if m == method and re.search(pattern, path):
                del self.faults[i]
                return fault
        return None


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """The S3 server for the session, the AWS environment pointing at it (through the proxy), one bucket."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    proxy = Proxy(port)
    env = {
        "AWS_ENDPOINT_URL": proxy.url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir(BUCKET)
    proxy.env, proxy.fs = env, fs
    proxy.local_dir = tmp_path_factory.mktemp("object-store")
    yield proxy
    server.stop()
    proxy.server.shutdown()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def as_format_3(folder: Path) -> None:
    """Rewrite a cache's manifest and index in the format-3 layout: every shard listed, the index gzipped JSON."""
    manifest = json.loads((folder / cf.MANIFEST).read_text())
    sides = [cf.read_sidecar(folder, i) for i in range(manifest["num_shards"])]
    for i, s in enumerate(sides):
        s["format_version"] = 3
        cf.atomic_write_json(cf.sidecar_path(folder, i), s)
    shutil.rmtree(folder / SHARD_INDEX)
    (folder / SHARD_INDEX).mkdir()
    text = json.dumps({"first": 0, "sidecars": sides}, sort_keys=True, separators=(",", ":"))
    data = gzip.compress(text.encode(), mtime=0)
    (folder / SHARD_INDEX / "part-000000.json.gz").write_bytes(data)
    manifest["shard_index"] = [
        {
            "path": f"{SHARD_INDEX}/part-000000.json.gz",
            "bytes": len(data),
            "sha256": sha256(data).hexdigest(),
            "shards": [0, len(sides)],
        }
    ]
    manifest["shards"] = [
        {"path": f"shards/{s['shard']}", "num_samples": s["count"], "bytes": s["bytes"], "sha256": s["sha256"]}
        for s in sides
    ]
    for key in ("num_shards", "bytes"):
        del manifest[key]
    manifest["format_version"] = 3
    (folder / cf.MANIFEST).write_text(json.dumps(manifest))
