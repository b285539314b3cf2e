"""A minimal in-memory Hub-compatible server for tests (no network, no LFS, no xet).

It implements just what huggingface_hub's ``create_repo``, ``create_branch``,
``upload_folder`` (preupload answers "regular", so file contents arrive inline in the
ndjson commit), ``model_info``/``repo_info``, ``list_repo_tree``, ``snapshot_download`` and
``hf_hub_download`` use. Start it with :func:`serve` and point ``HF_ENDPOINT`` at its URL.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit


def _git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    private: bool
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit sha
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> {path: content}
    messages: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> str | None:
        if revision in self.branches:
            return self.branches[revision]
        return revision if revision in self.commits else None


class HubState:
    """Repos in memory; ``token`` (if set) must be sent as ``Authorization: Bearer``."""

    def __init__(self, token: str | None = None):
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []
        self.auth_headers: list[str] = []
        self.validated_cards: list[str] = []

    def new_commit(self, repo: Repo, files: dict[str, bytes], message: str) -> str:
        sha = hashlib.sha1(f"{len(repo.commits)}:{message}:{sorted(files)}".encode()).hexdigest()
        repo.commits[sha] = files
        repo.messages[sha] = message
        return sha


class _Handler(BaseHTTPRequestHandler):
    state: HubState
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # keep test output quiet
        pass

    # ------------------------------------------------------------------ helpers
    def _send(self, status: int, body: bytes | dict | list = b"", headers: dict[str, str] | None = None, head=False):
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
            headers = {"Content-Type": "application/json", **(headers or {})}
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head and self.command != "HEAD":  # a body after a HEAD response corrupts the next one on the connection
            self.wfile.write(body)

    def _error(self, status: int, message: str, code: str | None = None):
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._send(status, {"error": message}, headers)

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _authorized(self) -> bool:
        auth = self.headers.get("Authorization")
        if auth:
            self.state.auth_headers.append(auth)
        return self.state.token is None or auth == f"Bearer {self.state.token}"

    def _repo(self, repo_id: str) -> Repo | None:
        repo = self.state.repos.get(repo_id)
        if repo is None:
            self._error(404, f"Repository {repo_id} not found", "RepoNotFound")
        return repo

    def _route(self, method: str):
        url = urlsplit(self.path)
        self.state.requests.append((method, url.path))
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        query = parse_qs(url.query)
        if method in ("POST", "PUT") and not self._authorized():
            return self._error(401, "Invalid credentials in Authorization header")
        with self.state.lock:
            if parts[:1] == ["api"]:
                return self._api(method, parts[1:], query)
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._resolve(method, "/".join(parts[:2]), parts[3], "/".join(parts[4:]))
        return self._error(404, f"unknown endpoint {method} {url.path}")

    def do_GET(self):
        self._route("GET")

    def do_HEAD(self):
        self._route("HEAD")

    def do_POST(self):
        self._route("POST")

    # ------------------------------------------------------------------ /api
    def _api(self, method: str, parts: list[str], query):
        if parts == ["repos", "create"] and method == "POST":
            payload = json.loads(self._body())
            repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
            if "/" not in repo_id:
                repo_id = f"user/{repo_id}"
            if repo_id in self.state.repos:  # the Hub answers 409 with the repo's url
                message = "You already created this model repo"
                return self._send(409, {"error": message, "url": f"{self._base()}/{repo_id}"}, {"X-Error-Message": message})
            repo = Repo(private=payload.get("private") or payload.get("visibility") == "private")
            repo.branches["main"] = self.state.new_commit(repo, {".gitattributes": b""}, "initial commit")
            self.state.repos[repo_id] = repo
            return self._send(200, {"url": f"{self._base()}/{repo_id}", "name": repo_id, "id": repo_id})
        if parts == ["validate-yaml"] and method == "POST":
            return self._validate_yaml(json.loads(self._body())["content"])
        if parts[:1] != ["models"] or len(parts) < 3:
            return self._error(404, f"unknown api endpoint {'/'.join(parts)}")
        repo_id, rest = "/".join(parts[1:3]), parts[3:]
        if method == "POST":
            self._body_cache = self._body()
        repo = self._repo(repo_id)
        if repo is None:
            return
        if not rest or rest[0] == "revision":
            revision = rest[1] if len(rest) > 1 else "main"
            return self._info(repo_id, repo, revision)
        action, revision = rest[0], "/".join(rest[1:]) or "main"
        if action == "tree" and method == "GET":
            sha = repo.resolve(revision)
            if sha is None:
                return self._error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
            files = repo.commits[sha]
            tree = [{"type": "file", "oid": _git_blob_sha(c), "size": len(c), "path": p} for p, c in sorted(files.items())]
            return self._send(200, tree)
        if action == "branch" and method == "POST":
            if revision in repo.branches:
                return self._error(409, f"Reference already exists: refs/heads/{revision}")
            repo.branches[revision] = repo.branches["main"]
            return self._send(200, {})
        if action == "preupload" and method == "POST":
            files = json.loads(self._body_cache)["files"]
            return self._send(
                200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
            )
        if action == "commit" and method == "POST":
            return self._commit(repo_id, repo, revision)
        return self._error(404, f"unknown api endpoint {'/'.join(parts)}")

    def _validate_yaml(self, content: str):
        """The README's metadata block must be a YAML mapping (what the Hub checks first)."""
        import yaml

        errors = []
        if content.startswith("---"):
            block = content.split("---", 2)[1]
            try:
                data = yaml.safe_load(block)
                if data is not None and not isinstance(data, dict):
                    errors.append({"message": "metadata is not a mapping"})
            except yaml.YAMLError as e:
                errors.append({"message": f"invalid YAML: {e}"})
        self.state.validated_cards.append(content)
        return self._send(400 if errors else 200, {"errors": errors, "warnings": []})

    def _base(self) -> str:
        return f"http://{self.headers.get('Host')}"

    def _info(self, repo_id: str, repo: Repo, revision: str):
        sha = repo.resolve(revision)
        if sha is None:
            return self._error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        siblings = [{"rfilename": p, "size": len(c), "blobId": _git_blob_sha(c)} for p, c in sorted(repo.commits[sha].items())]
        return self._send(
            200,
            {
                "_id": repo_id,
                "id": repo_id,
                "modelId": repo_id,
                "sha": sha,
                "private": repo.private,
                "siblings": siblings,
                "tags": [],
                "downloads": 0,
                "likes": 0,
            },
        )

    def _commit(self, repo_id: str, repo: Repo, revision: str):
        if revision not in repo.branches:
            return self._error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        files = dict(repo.commits[repo.branches[revision]])
        summary = ""
        for line in self._body_cache.splitlines():
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                summary = value.get("summary", "")
            elif key == "file":
                if value.get("encoding") != "base64":
                    return self._error(400, "only base64 inline files are supported")
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                files.pop(value["path"], None)
            else:
                return self._error(400, f"unsupported commit operation {key} (no LFS on this server)")
        sha = self.state.new_commit(repo, files, summary)
        repo.branches[revision] = sha
        return self._send(200, {"commitUrl": f"{self._base()}/{repo_id}/commit/{sha}", "commitOid": sha, "success": True})

    # ------------------------------------------------------------------ file downloads
    def _resolve(self, method: str, repo_id: str, revision: str, path: str):
        repo = self._repo(repo_id)
        if repo is None:
            return
        sha = repo.resolve(revision)
        if sha is None:
            return self._error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        content = repo.commits[sha].get(path)
        if content is None:
            return self._error(404, f"Entry not found: {path}", "EntryNotFound")
        headers = {"X-Repo-Commit": sha, "ETag": f'"{_git_blob_sha(content)}"', "Accept-Ranges": "bytes"}
        status, body = 200, content
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            start, _, end = rng[len("bytes=") :].partition("-")
            start_i = int(start) if start else max(0, len(content) - int(end))
            end_i = int(end) if start and end else len(content) - 1
            body = content[start_i : end_i + 1]
            status = 206
            headers["Content-Range"] = f"bytes {start_i}-{start_i + len(body) - 1}/{len(content)}"
        self._send(status, body, headers, head=method == "HEAD")


def serve(token: str | None = None, host: str = "127.0.0.1"):
    """Start the server on a free port in a daemon thread; returns ``(url, state, server)``."""
    state = HubState(token=token)
    handler = type("Handler", (_Handler,), {"state": state})
    server = ThreadingHTTPServer((host, 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://{host}:{server.server_address[1]}", state, server
