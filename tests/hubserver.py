"""A minimal Hugging Face Hub on loopback, for tests: only what `huggingface_hub` 2.4 needs.

The real client runs unmodified against it (`HF_ENDPOINT=http://127.0.0.1:PORT`,
`HF_HUB_DISABLE_XET=1`). Covered, with the real request and response shapes:

    POST /api/repos/create                                  create_repo (409 + url when it exists)
    POST /api/validate-yaml                                 README.md front matter check (only:
                                                            it opens and closes with ---)
    GET  /api/models/{repo}[/revision/{rev}]                repo_info / model_info (siblings, sha)
    GET  /api/models/{repo}/tree/{rev}                      list_repo_tree (snapshot_download), one page
    POST /api/models/{repo}/branch/{branch}                 create_branch
    POST /api/models/{repo}/preupload/{rev}                 upload mode per file ("lfs"/"regular"),
                                                            remote oid of the file already there
    POST /{repo}.git/info/lfs/objects/batch                 LFS batch ("basic" transfer); objects the
                                                            store already holds get no actions
    PUT  /lfs-upload/{oid}                                  the bytes (sha256 checked against oid)
    POST /{repo}.git/info/lfs/objects/verify                LFS verify
    POST /api/models/{repo}/commit/{rev}                    NDJSON commit (file, lfsFile, deletedFile);
                                                            ?create_pr=1: onto refs/pr/N, pullRequestUrl
    GET  /api/whoami-v2                                     whoami: user `user_name` for the token
    HEAD/GET /{repo}/resolve/{rev}/{path}                   downloads, with Range (safetensors headers)
    GET  /api/datasets/{repo}[/revision/{rev}], .../tree/{rev}, HEAD/GET /datasets/{repo}/resolve/...
                                                            the same for dataset repos (read only)

Not covered (only the real Hub shows them): the Xet storage protocol (chunk dedup, the default
upload path when hf_xet is installed), LFS multipart, auth scopes and orgs, rate limits,
gitattributes-driven LFS rules, PRs, server-side file size limits.

Knobs for tests: `token` (writes need `Bearer <token>`), `stall_after` (hold the PUT of every LFS
object after the first N completed ones open until `release` is set: a deterministic
"interrupted upload"). `requests` records (method, path, Range header) of every call.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
LFS_MIN_BYTES = 10 * 2**20  # the Hub stores files over 10 MB in LFS whatever their name


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class RepoFile:
    data: bytes
    lfs: bool

    @property
    def oid(self) -> str:
        return hashlib.sha256(self.data).hexdigest() if self.lfs else git_blob_sha1(self.data)


@dataclass
class Repo:
    repo_id: str
    private: bool
    branches: dict[str, dict[str, RepoFile]] = field(default_factory=lambda: {"main": {}})
    heads: dict[str, str] = field(default_factory=lambda: {"main": "0" * 40})
    commits: list[dict] = field(default_factory=list)


class HubState:
    def __init__(self, token: str | None = None, stall_after: int | None = None):
        self.token = token
        self.user_name = "tester"  # whoami's answer for the token
        self.stall_after = stall_after
        self.release = threading.Event()
        self.stalled = threading.Event()  # set when an upload is being held
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.uploads: list[str] = []  # oids whose PUT completed, in order
        self.requests: list[tuple[str, str, str | None]] = []
        self.auth_seen: list[str] = []
        self.lock = threading.Lock()

    def add_repo(self, repo_id: str, folder, private: bool = False, repo_type: str = "model") -> str:
        """Seed `repo_id` with the files of a local folder (one commit); return its sha. A
        "dataset" repo takes the folder's files recursively (`data/train-....parquet`) and is
        served under /api/datasets/ and /datasets/."""
        from pathlib import Path

        root = Path(folder)
        found = sorted(root.rglob("*")) if repo_type == "dataset" else sorted(root.iterdir())
        files = {p.relative_to(root).as_posix(): RepoFile(p.read_bytes(), p.name.endswith(LFS_SUFFIXES))
                 for p in found if p.is_file()}
        sha = hashlib.sha1(repr(sorted((n, f.oid) for n, f in files.items())).encode()).hexdigest()
        r = Repo(repo_id, private, {"main": files}, {"main": sha})
        r.commits.append({"oid": sha, "revision": "main", "summary": "seed", "files": sorted(files)})
        with self.lock:
            self.repos[("datasets/" if repo_type == "dataset" else "") + repo_id] = r
        return sha

    def files(self, repo_id: str, rev: str = "main") -> dict[str, bytes]:
        return {p: f.data for p, f in self.repos[repo_id].branches[rev].items()}


_REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"
ROUTES = [
    ("POST", re.compile(r"^/api/repos/create$"), "create_repo"),
    ("GET", re.compile(r"^/api/whoami-v2$"), "whoami"),
    ("POST", re.compile(r"^/api/validate-yaml$"), "validate_yaml"),
    ("GET", re.compile(rf"^/api/models/{_REPO}(?:/revision/(?P<rev>[^/]+))?$"), "repo_info"),
    ("GET", re.compile(rf"^/api/models/{_REPO}/tree/(?P<rev>[^/]+)/?$"), "tree"),
    # dataset repos (read only): keyed "datasets/ORG/NAME" in HubState.repos
    ("GET", re.compile(rf"^/api/(?P<kind>datasets)/{_REPO}(?:/revision/(?P<rev>[^/]+))?$"), "repo_info"),
    ("GET", re.compile(rf"^/api/(?P<kind>datasets)/{_REPO}/tree/(?P<rev>[^/]+)/?$"), "tree"),
    ("GET", re.compile(rf"^/(?P<kind>datasets)/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "resolve"),
    ("HEAD", re.compile(rf"^/(?P<kind>datasets)/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "resolve"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/branch/(?P<rev>[^/]+)$"), "create_branch"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/preupload/(?P<rev>[^/]+)$"), "preupload"),
    ("POST", re.compile(rf"^/{_REPO}\.git/info/lfs/objects/batch$"), "lfs_batch"),
    ("POST", re.compile(rf"^/{_REPO}\.git/info/lfs/objects/verify$"), "lfs_verify"),
    ("PUT", re.compile(r"^/lfs-upload/(?P<oid>[0-9a-f]{64})$"), "lfs_put"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/commit/(?P<rev>[^/]+)$"), "commit"),
    ("GET", re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "resolve"),
    ("HEAD", re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "resolve"),
]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: HubState  # set on the subclass by `serve`

    def log_message(self, *args) -> None:  # quiet: tests read their own output
        pass

    # -- plumbing ---------------------------------------------------------------------------

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(n) if n else b""
        if len(data) != n:
            raise ConnectionAbortedError("the client went away mid-request")
        return data

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None,
              ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers)

    def _error(self, status: int, msg: str, code: str | None = None) -> None:
        self._json(status, {"error": msg}, {"X-Error-Code": code} if code else None)

    def _authorized(self) -> bool:
        auth = self.headers.get("Authorization", "")
        with self.state.lock:
            self.state.auth_seen.append(auth)
        return self.state.token is None or auth == f"Bearer {self.state.token}"

    def _base(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def _dispatch(self) -> None:
        path = unquote(urlsplit(self.path).path)
        with self.state.lock:
            self.state.requests.append((self.command, path, self.headers.get("Range")))
        for method, rx, name in ROUTES:
            m = rx.match(path)
            if m and method == self.command:
                return getattr(self, name)(**m.groupdict())
        self._error(404, f"no route {self.command} {path}")

    do_GET = do_POST = do_PUT = do_HEAD = _dispatch

    def _repo(self, repo: str, kind: str | None = None) -> Repo | None:
        r = self.state.repos.get(f"{kind}/{repo}" if kind else repo)
        if r is None:
            self._error(404, f"Repository not found: {repo}", "RepoNotFound")
        return r

    # -- routes ------------------------------------------------------------------------------

    def create_repo(self) -> None:
        req = json.loads(self._body())
        if not self._authorized():
            return self._error(401, "Invalid credentials in Authorization header")
        repo_id = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
        url = f"{self._base()}/{repo_id}"
        with self.state.lock:
            if repo_id in self.state.repos:
                return self._json(409, {"error": "You already created this model repo", "url": url})
            private = req.get("visibility") == "private" or bool(req.get("private"))
            self.state.repos[repo_id] = Repo(repo_id, private)
        self._json(200, {"url": url, "name": repo_id})

    def whoami(self) -> None:
        if not self._authorized() or self.state.token is None:
            return self._error(401, "Invalid credentials in Authorization header")
        self._json(200, {"type": "user", "name": self.state.user_name, "orgs": [],
                         "auth": {"type": "access_token", "accessToken": {"role": "write"}}})

    def validate_yaml(self) -> None:
        content = json.loads(self._body())["content"]
        parts = content.split("---\n")
        if content.startswith("---\n") and len(parts) < 3:
            return self._json(400, {"errors": [{"message": "unterminated YAML front matter"}]})
        self._json(200, {"errors": [], "warnings": []})

    def repo_info(self, repo: str, rev: str | None = None, kind: str | None = None) -> None:
        r = self._repo(repo, kind)
        if r is None:
            return
        branch = self._branch(r, rev or "main")
        if branch is None:
            return self._error(404, f"Revision not found: {rev}", "RevisionNotFound")
        files = r.branches[branch]
        self._json(200, {
            "id": repo, "modelId": repo, "sha": r.heads[branch], "private": r.private,
            "siblings": [{"rfilename": p, "size": len(f.data)} for p, f in sorted(files.items())],
        })

    def tree(self, repo: str, rev: str, kind: str | None = None) -> None:
        r = self._repo(repo, kind)
        if r is None:
            return
        branch = self._branch(r, rev)
        if branch is None:
            return self._error(404, f"Revision not found: {rev}", "RevisionNotFound")
        entries = []
        for p, f in sorted(r.branches[branch].items()):
            e = {"type": "file", "path": p, "size": len(f.data), "oid": git_blob_sha1(f.data)}
            if f.lfs:
                e["lfs"] = {"oid": f.oid, "size": len(f.data), "pointerSize": 134}
            entries.append(e)
        self._json(200, entries)

    @staticmethod
    def _branch(r: Repo, rev: str) -> str | None:
        """A branch name or the head commit of one -> the branch."""
        return rev if rev in r.branches else next((b for b, h in r.heads.items() if h == rev), None)

    def create_branch(self, repo: str, rev: str) -> None:
        self._body()
        if not self._authorized():
            return self._error(401, "Invalid credentials in Authorization header")
        r = self._repo(repo)
        if r is None:
            return
        with self.state.lock:
            if rev in r.branches:
                return self._error(409, f"Reference already exists: refs/heads/{rev}")
            r.branches[rev] = dict(r.branches["main"])
            r.heads[rev] = r.heads["main"]
        self._json(200, {})

    def preupload(self, repo: str, rev: str) -> None:
        req = json.loads(self._body())
        if not self._authorized():
            return self._error(401, "Invalid credentials in Authorization header")
        r = self._repo(repo)
        if r is None:
            return
        have = r.branches.get(rev, {})
        files = []
        for f in req["files"]:
            lfs = f["path"].endswith(LFS_SUFFIXES) or f["size"] >= LFS_MIN_BYTES
            existing = have.get(f["path"])
            files.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular",
                          "shouldIgnore": False, "oid": existing.oid if existing else None})
        self._json(200, {"files": files, "commitOid": r.heads.get(rev, "0" * 40)})

    def lfs_batch(self, repo: str) -> None:
        req = json.loads(self._body())
        if not self._authorized():
            return self._error(401, "Invalid credentials in Authorization header")
        if self._repo(repo) is None:
            return
        objects = []
        for o in req["objects"]:
            if o["oid"] in self.state.lfs:
                objects.append({"oid": o["oid"], "size": o["size"]})  # already stored: no actions
            else:
                objects.append({"oid": o["oid"], "size": o["size"], "actions": {
                    "upload": {"href": f"{self._base()}/lfs-upload/{o['oid']}"},
                    "verify": {"href": f"{self._base()}/{repo}.git/info/lfs/objects/verify"},
                }})
        self._json(200, {"transfer": "basic", "objects": objects},
                   {"Content-Type": "application/vnd.git-lfs+json"})

    def lfs_put(self, oid: str) -> None:
        data = self._body()
        st = self.state
        if hashlib.sha256(data).hexdigest() != oid:
            return self._error(400, "sha256 of the body does not match the oid")
        with st.lock:
            stall = st.stall_after is not None and len(st.uploads) >= st.stall_after
            if not stall:
                st.lfs[oid] = data
                st.uploads.append(oid)
        if stall:
            st.stalled.set()
            st.release.wait(timeout=60)  # the test kills the client meanwhile
            return self._error(503, "stalled upload released")
        self._send(200, b"", ctype="text/plain")

    def lfs_verify(self, repo: str) -> None:
        req = json.loads(self._body())
        data = self.state.lfs.get(req["oid"])
        if data is None or len(data) != req["size"]:
            return self._error(404, f"object {req['oid']} not stored with size {req['size']}")
        self._json(200, {})

    def commit(self, repo: str, rev: str) -> None:
        lines = [json.loads(x) for x in self._body().splitlines() if x.strip()]
        if not self._authorized():
            return self._error(401, "Invalid credentials in Authorization header")
        r = self._repo(repo)
        if r is None:
            return
        if rev not in r.branches:
            return self._error(404, f"Revision not found: {rev}", "RevisionNotFound")
        new = dict(r.branches[rev])
        pr = "create_pr=1" in urlsplit(self.path).query.split("&") or \
            "create_pr=True" in urlsplit(self.path).query.split("&")
        if pr:  # a pull request: the commit goes onto a new refs/pr/N, the base stays
            n = 1 + sum(b.startswith("refs/pr/") for b in r.branches)
            base, rev = rev, f"refs/pr/{n}"
            r.heads[rev] = r.heads[base]
        summary = ""
        for item in lines:
            key, v = item["key"], item["value"]
            if key == "header":
                summary = v["summary"]
            elif key == "file":
                new[v["path"]] = RepoFile(base64.b64decode(v["content"]), lfs=False)
            elif key == "lfsFile":
                data = self.state.lfs.get(v["oid"])
                if data is None:
                    return self._error(422, f"LFS object {v['oid']} for {v['path']} was never uploaded")
                new[v["path"]] = RepoFile(data, lfs=True)
            elif key in ("deletedFile", "deletedFolder"):
                new.pop(v["path"], None)
        with self.state.lock:
            oid = hashlib.sha1(json.dumps([r.heads[rev], summary, sorted(
                (p, f.oid) for p, f in new.items())]).encode()).hexdigest()
            r.branches[rev] = new
            r.heads[rev] = oid
            r.commits.append({"oid": oid, "revision": rev, "summary": summary, "files": sorted(new)})
        self._json(200, {"commitUrl": f"{self._base()}/{repo}/commit/{oid}", "commitOid": oid,
                         "pullRequestUrl": f"{self._base()}/{repo}/discussions/{rev.rsplit('/', 1)[-1]}"
                         if pr else None})

    def resolve(self, repo: str, rev: str, path: str, kind: str | None = None) -> None:
        r = self._repo(repo, kind)
        if r is None:
            return
        branch = self._branch(r, rev)
        if branch is None:
            return self._error(404, f"Revision not found: {rev}", "RevisionNotFound")
        f = r.branches[branch].get(path)
        if f is None:
            return self._error(404, f"Entry not found: {path}", "EntryNotFound")
        headers = {"X-Repo-Commit": r.heads[branch], "ETag": f'"{f.oid}"', "Accept-Ranges": "bytes"}
        data = f.data
        m = re.match(r"bytes=(\d+)-(\d*)$", self.headers.get("Range", ""))
        if m and self.command == "GET":
            a, b = int(m.group(1)), int(m.group(2)) if m.group(2) else len(data) - 1
            b = min(b, len(data) - 1)
            headers["Content-Range"] = f"bytes {a}-{b}/{len(data)}"
            return self._send(206, data[a:b + 1], headers, "application/octet-stream")
        self._send(200, data, headers, "application/octet-stream")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, json.JSONDecodeError)):
            super().handle_error(request, client_address)  # a killed client is expected; bugs are not


class Hub:
    """A running loopback hub: `url`, `state`, `close()` (also a context manager)."""

    def __init__(self, state: HubState):
        handler = type("Handler", (_Handler,), {"state": state})
        self.state = state
        self.server = _Server(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.state.release.set()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
