"""A local stand-in for the Hugging Face Hub's file API, enough for ``snapshot_download``
pointed at it (``HF_ENDPOINT`` / ``endpoint=``): the revision's info, the file tree, and
each file's metadata (HEAD) and bytes (GET) under ``/<repo>/resolve/<revision>/<path>``.

One repo, one commit; branches named in ``refs`` resolve to it. With a ``token`` every
request must carry ``Authorization: Bearer <token>`` (401 otherwise), as a gated or
private repo needs. ``requests`` records (method, path) of each request.
"""

from __future__ import annotations

import hashlib
import json
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class FakeRepo:
    repo: str
    files: dict[str, bytes]
    sha: str = "0123456789abcdef0123456789abcdef01234567"
    refs: tuple[str, ...] = ("main",)
    token: str | None = None
    requests: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def from_dir(cls, repo: str, directory: Path, **kwargs: object) -> FakeRepo:
        files = {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}
        return cls(repo, files, **kwargs)  # type: ignore[arg-type]

    def resolves(self, revision: str) -> bool:
        return revision == self.sha or revision in self.refs


def _oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # noqa: S324 - git's


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def do_HEAD(self) -> None:  # noqa: N802
        self._serve(body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._serve(body=True)

    def _serve(self, *, body: bool) -> None:
        hub = self.server.hub
        path = urllib.parse.urlparse(self.path).path
        hub.requests.append((self.command, path))
        if hub.token is not None and self.headers.get("authorization") != f"Bearer {hub.token}":
            return self._send(401, b'{"error": "Invalid credentials"}', body=body)
        prefix = f"/api/models/{hub.repo}/"
        if path.startswith(prefix):
            kind, _, rest = path[len(prefix) :].partition("/")
            revision = urllib.parse.unquote(rest.split("/")[0])
            if not hub.resolves(revision):
                return self._send(404, b"{}", {"X-Error-Code": "RevisionNotFound"}, body=body)
            if kind == "revision":
                info = {
                    "id": hub.repo,
                    "modelId": hub.repo,
                    "sha": hub.sha,
                    "private": hub.token is not None,
                    "siblings": [{"rfilename": name} for name in hub.files],
                }
                return self._send(200, json.dumps(info).encode(), body=body)
            if kind == "tree":
                tree = [
                    {"type": "file", "path": n, "size": len(d), "oid": _oid(d)}
                    for n, d in hub.files.items()
                ]
                return self._send(200, json.dumps(tree).encode(), body=body)
        prefix = f"/{hub.repo}/resolve/"
        if path.startswith(prefix):
            revision, _, name = path[len(prefix) :].partition("/")
            name = urllib.parse.unquote(name)
            if not hub.resolves(urllib.parse.unquote(revision)) or name not in hub.files:
                return self._send(404, b"{}", {"X-Error-Code": "EntryNotFound"}, body=body)
            data = hub.files[name]
            headers = {"X-Repo-Commit": hub.sha, "ETag": f'"{_oid(data)}"'}
            return self._send(
                200, data, headers, body=body, content_type="application/octet-stream"
            )
        self._send(404, b"{}", {"X-Error-Code": "RepoNotFound"}, body=body)

    def _send(
        self,
        status: int,
        data: bytes,
        headers: dict[str, str] | None = None,
        *,
        body: bool,
        content_type: str = "application/json",
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if body:
            self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, hub: FakeRepo) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.hub = hub


@contextmanager
def serve(hub: FakeRepo) -> Iterator[str]:
    """Serve ``hub`` on a free loopback port for the block; yields its endpoint URL."""
    server = _Server(hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
