"""A small Hugging Face Hub stand-in on 127.0.0.1, for the real ``huggingface_hub`` client.

It implements exactly what :mod:`clover_desk.downloads` makes the client call (read from huggingface_hub 2.x):

* ``GET /api/models/{repo}/revision/{rev}``: model info (``id``, ``sha``, ``siblings``);
* ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=…``: the file list with ``oid``, ``size`` and, for LFS
  files, ``lfs: {oid: sha256, size, pointerSize}``;
* ``HEAD|GET /{repo}/resolve/{rev}/{file}``: small files answer 200 with ``ETag`` (the git blob id),
  ``Content-Length`` and ``X-Repo-Commit``; LFS files answer 302 to a second "CDN" server (another port, so
  another origin, as on the real Hub) with ``X-Linked-Etag`` (the sha256), ``X-Linked-Size`` and
  ``X-Repo-Commit``, which the client reads from the redirect itself;
* ``GET /cdn/{sha256}`` on the CDN server, with ``Range: bytes=N-`` (206 + ``Content-Range``).

Unknown repos get 404 with ``X-Error-Code: RepoNotFound`` (the client turns it into RepositoryNotFoundError).
Faults for tests: ``cut_after[path] = n`` closes the next transfer of ``path`` after ``n`` bytes (the client
sees a short read), ``corrupt_once`` serves flipped bytes once, ``chunk_delay_s`` slows every 64 KiB chunk.
Every request is recorded in ``requests`` as ``(server, method, path, headers)``.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

CHUNK = 64 * 1024


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    repo_id: str
    files: dict[str, bytes]
    lfs: set[str]  # paths stored in LFS (sha256 in the tree, served from the CDN)
    sha: str = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class HubState:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    cut_after: dict[str, int] = field(default_factory=dict)  # path -> bytes sent before hanging up (once)
    corrupt_once: set[str] = field(default_factory=set)
    chunk_delay_s: float = 0.0
    requests: list[tuple[str, str, str, dict[str, str]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def by_sha(self, sha256: str) -> tuple[str, bytes] | None:
        for repo in self.repos.values():
            for path, data in repo.files.items():
                if path in repo.lfs and hashlib.sha256(data).hexdigest() == sha256:
                    return path, data
        return None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (base-class name)
        return  # quiet: tests read HubState.requests instead

    # ---- plumbing ----

    def _record(self) -> None:
        with self.server.state.lock:
            self.server.state.requests.append(
                (self.server.role, self.command, self.path, {k.lower(): v for k, v in self.headers.items()})
            )

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj: object, headers: dict[str, str] | None = None) -> None:
        self._send(200, json.dumps(obj).encode(), headers)

    def _not_found(self, code: str, message: str) -> None:
        self._send(404, json.dumps({"error": message}).encode(), {"X-Error-Code": code, "X-Error-Message": message})

    def do_HEAD(self) -> None:  # noqa: N802 (http.server naming)
        self._record()
        self._route()

    def do_GET(self) -> None:  # noqa: N802
        self._record()
        self._route()

    def _route(self) -> None:
        path = unquote(urlsplit(self.path).path)
        if self.server.role == "cdn":
            match = re.fullmatch(r"/cdn/([0-9a-f]{64})", path)
            found = self.server.state.by_sha(match.group(1)) if match else None
            if found is None:
                self._send(404, b"no such blob", content_type="text/plain")
                return
            self._serve_bytes(*found)
            return
        for repo_id, repo in self.server.state.repos.items():
            for prefix, handler in ((f"/api/models/{repo_id}/revision/", self._model_info),
                                    (f"/api/models/{repo_id}/tree/", self._tree),
                                    (f"/{repo_id}/resolve/", self._resolve)):
                if path.startswith(prefix):
                    handler(repo, path[len(prefix):])
                    return
        if path.startswith(("/api/models/", "/")):
            self._not_found("RepoNotFound", "Repository not found")

    # ---- Hub API ----

    def _model_info(self, repo: FakeRepo, revision: str) -> None:
        if revision not in ("main", repo.sha):
            self._not_found("RevisionNotFound", f"Invalid rev id: {revision}")
            return
        self._json({"id": repo.repo_id, "modelId": repo.repo_id, "sha": repo.sha, "private": False,
                    "siblings": [{"rfilename": p} for p in repo.files]})

    def _tree(self, repo: FakeRepo, rest: str) -> None:
        revision, _, sub = rest.partition("/")
        if revision not in ("main", repo.sha):
            self._not_found("RevisionNotFound", f"Invalid rev id: {revision}")
            return
        entries = []
        folders = set()
        for p, data in sorted(repo.files.items()):
            if sub and not p.startswith(sub.rstrip("/") + "/"):
                continue
            parts = p.split("/")
            for i in range(1, len(parts)):
                folders.add("/".join(parts[:i]))
            entry = {"type": "file", "oid": git_blob_id(data), "size": len(data), "path": p}
            if p in repo.lfs:
                pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
                entry["oid"] = git_blob_id(pointer.encode())
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                                "pointerSize": len(pointer)}
            entries.append(entry)
        entries += [{"type": "directory", "oid": "0" * 40, "size": 0, "path": f} for f in sorted(folders)]
        self._json(entries)

    def _resolve(self, repo: FakeRepo, rest: str) -> None:
        revision, _, filename = rest.partition("/")
        if revision not in ("main", repo.sha):
            self._not_found("RevisionNotFound", f"Invalid rev id: {revision}")
            return
        data = repo.files.get(filename)
        if data is None:
            self._send(404, b'{"error": "Entry not found"}',
                       {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.sha})
            return
        if filename in repo.lfs:
            sha256 = hashlib.sha256(data).hexdigest()
            location = f"{self.server.cdn_url}/cdn/{sha256}"
            self._send(302, b"", {"Location": location, "X-Repo-Commit": repo.sha, "ETag": f'"{git_blob_id(data)}"',
                                  "X-Linked-Etag": f'"{sha256}"', "X-Linked-Size": str(len(data))})
            return
        self._serve_bytes(filename, data, {"ETag": f'"{git_blob_id(data)}"', "X-Repo-Commit": repo.sha})

    # ---- file bytes, with Range and faults ----

    def _serve_bytes(self, path: str, data: bytes, extra: dict[str, str] | None = None) -> None:
        state = self.server.state
        start = 0
        status = 200
        headers = dict(extra or {})
        headers["Accept-Ranges"] = "bytes"
        range_header = self.headers.get("Range")
        if range_header:
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", range_header.strip())
            if match:
                start = int(match.group(1))
                if start >= len(data):
                    self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
                    return
                status = 206
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        with state.lock:
            if self.command == "GET" and path in state.corrupt_once:
                state.corrupt_once.discard(path)
                body = bytes(b ^ 0xFF for b in body[:16]) + body[16:]
            cut = state.cut_after.pop(path, None) if self.command == "GET" else None
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command == "HEAD":
            return
        sent = 0
        limit = len(body) if cut is None else min(cut, len(body))
        while sent < limit:
            piece = body[sent : min(sent + CHUNK, limit)]
            try:
                self.wfile.write(piece)
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                return
            sent += len(piece)
            if state.chunk_delay_s:
                time.sleep(state.chunk_delay_s)
        if cut is not None:
            self.close_connection = True  # hang up mid-body: the client sees a short read


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, role: str, state: HubState) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.role = role
        self.state = state
        self.cdn_url = ""


class FakeHub:
    """The Hub API server plus its "CDN", both on 127.0.0.1. Use as a context manager."""

    def __init__(self) -> None:
        self.state = HubState()
        self._hub = _Server("hub", self.state)
        self._cdn = _Server("cdn", self.state)
        self._hub.cdn_url = self._cdn_url = f"http://127.0.0.1:{self._cdn.server_address[1]}"
        self.endpoint = f"http://127.0.0.1:{self._hub.server_address[1]}"
        self._threads = [threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
                         for s in (self._hub, self._cdn)]

    def add_repo(self, repo_id: str, files: dict[str, bytes], lfs: set[str] | None = None) -> FakeRepo:
        repo = FakeRepo(repo_id, dict(files), set(lfs or ()))
        self.state.repos[repo_id] = repo
        return repo

    def requests_for(self, path_part: str, method: str = "GET") -> list[dict[str, str]]:
        with self.state.lock:
            return [h for _, m, p, h in self.state.requests if m == method and path_part in p]

    def __enter__(self) -> "FakeHub":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for server in (self._hub, self._cdn):
            server.shutdown()
            server.server_close()
