"""`forkpoint ui`: a read-only local web page of a repository's lineage, metrics and diffs.

The page (ui/index.html, app.js, style.css, shipped in the package: no CDN) asks the JSON
API below; the server only reads the repository. Static files come from a fixed list, never
from a path in the request.
"""

import json
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources

from ..errors import ForkpointError
from ..repo import Repo
from . import webapi

ASSETS = {"/": ("index.html", "text/html; charset=utf-8"),
          "/app.js": ("app.js", "text/javascript; charset=utf-8"),
          "/style.css": ("style.css", "text/css; charset=utf-8")}


def _asset(name: str) -> bytes:
    return resources.files("forkpoint.cli").joinpath("ui", name).read_bytes()


class Api:
    """Routes of the JSON API over one repository."""

    def __init__(self, repo: Repo):
        self.repo = repo
        self.lineage = webapi.LineageView(repo)

    def answer(self, path: str, query: dict):
        repo = self.repo
        if path == "/api/versions":
            return self.lineage.page(*webapi.paging(query))
        if path.startswith("/api/version/"):
            return webapi.version_detail(repo, urllib.parse.unquote(path[len("/api/version/"):]))
        if path == "/api/diff":
            return webapi.diff(repo, _arg(query, "a"), _arg(query, "b"))
        if path == "/api/divergence":
            try:
                atol = float(query.get("atol", 0.0))
            except ValueError:
                raise webapi.BadRequest("atol must be a number") from None
            return webapi.divergence(repo, _arg(query, "a"), _arg(query, "b"), atol)
        if path == "/api/metrics":
            return {"metrics": webapi.metric_names(repo)}
        if path == "/api/series":
            return webapi.metric_series(repo, _arg(query, "metric"))
        if path == "/api/du":
            return repo.du()
        if path == "/api/repo":
            return {"url": repo.url, "branches": repo.branches(), "tags": repo.tags()}
        raise webapi.NotFound(f"no API route {path[:80]!r}")


def _arg(query: dict, name: str) -> str:
    if name not in query:
        raise webapi.BadRequest(f"missing query parameter {name!r}")
    return query[name]


def make_handler(api: Api):
    class Handler(BaseHTTPRequestHandler):
        server_version = "forkpoint-ui"

        def do_GET(self):
            url = urllib.parse.urlsplit(self.path)
            if url.path in ASSETS:
                name, kind = ASSETS[url.path]
                return self._send(200, _asset(name), kind)
            if url.path == "/favicon.ico":
                return self._send(204, b"", "image/x-icon")
            if not url.path.startswith("/api/"):
                return self._json(404, {"error": "not found"})
            query = dict(urllib.parse.parse_qsl(url.query))
            try:
                return self._json(200, api.answer(url.path, query))
            except webapi.NotFound as e:
                return self._json(404, {"error": str(e)})
            except webapi.BadRequest as e:
                return self._json(400, {"error": str(e)})
            except ForkpointError as e:
                return self._json(500, {"error": f"{type(e).__name__}: {e}"})

        def do_POST(self):
            self._json(405, {"error": "the forkpoint page is read-only"})

        do_PUT = do_DELETE = do_PATCH = do_POST

        def _json(self, status: int, data) -> None:
            self._send(status, json.dumps(data, default=str, allow_nan=False).encode(), "application/json")

        def _send(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Security-Policy", "default-src 'self'; style-src 'self'; img-src 'self' data:")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # quiet: the page polls nothing, errors reach the client
            pass

    return Handler


def serve(repo: Repo, host: str = "127.0.0.1", port: int = 8765) -> ThreadingHTTPServer:
    """A server for `repo` bound to host:port (port 0: any free port); call serve_forever()."""
    server = ThreadingHTTPServer((host, port), make_handler(Api(repo)))
    server.daemon_threads = True
    return server
