"""A stand-in for the few Grafana HTTP API routes `tokenflow dashboards push` calls.

No Grafana server can run here, so this loopback server implements, after Grafana's documented
HTTP API: bearer-token auth, `GET /api/health`, `GET /api/folders/:uid`, `POST /api/folders`,
`POST /api/dashboards/db` (create, or update by uid when `overwrite` is true; a uid that exists
without `overwrite` is refused with 412, as Grafana does) and `GET /api/dashboards/uid/:uid`.
It records every request so tests can see what the client did.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeGrafana:
    """Owns the server thread and the state: folders, dashboards (with versions), requests."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.folders: dict[str, dict[str, Any]] = {}
        self.dashboards: dict[str, dict[str, Any]] = {}  # uid -> {"dashboard", "folderUid", ...}
        self.requests: list[tuple[str, str]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ----------------------------------------------------------------------------- routes
    def route(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        self.requests.append((method, path))
        if method == "GET" and path == "/api/health":
            return 200, {"database": "ok", "version": "11.3.0"}
        if method == "GET" and path.startswith("/api/folders/"):
            folder = self.folders.get(path.rsplit("/", 1)[1])
            return (200, folder) if folder else (404, {"message": "folder not found"})
        if method == "POST" and path == "/api/folders":
            uid = body.get("uid") or f"f{len(self.folders)}"
            if uid in self.folders:
                return 409, {"message": "a folder with the same uid already exists"}
            self.folders[uid] = {"id": len(self.folders) + 1, "uid": uid, "title": body["title"]}
            return 200, self.folders[uid]
        if method == "POST" and path == "/api/dashboards/db":
            return self._save_dashboard(body)
        if method == "GET" and path.startswith("/api/dashboards/uid/"):
            saved = self.dashboards.get(path.rsplit("/", 1)[1])
            return (200, saved) if saved else (404, {"message": "Dashboard not found"})
        return 404, {"message": "Not found"}

    def _save_dashboard(self, body: dict[str, Any]) -> tuple[int, Any]:
        dashboard = dict(body["dashboard"])
        uid = dashboard["uid"]
        if body.get("folderUid") and body["folderUid"] not in self.folders:
            return 400, {"message": "folder not found"}
        old = self.dashboards.get(uid)
        if old is not None and not body.get("overwrite"):
            return 412, {"message": "A dashboard with the same uid already exists",
                         "status": "name-exists"}
        version = 1 if old is None else old["dashboard"]["version"] + 1
        dashboard.update(id=len(self.dashboards) + 1 if old is None else old["dashboard"]["id"],
                         version=version)
        self.dashboards[uid] = {"dashboard": dashboard, "folderUid": body.get("folderUid")}
        return 200, {"id": dashboard["id"], "uid": uid, "url": f"/d/{uid}", "status": "success",
                     "version": version, "slug": uid}

    # ---------------------------------------------------------------------------- plumbing
    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self, method: str) -> None:
                if self.headers.get("Authorization") != f"Bearer {fake.token}":
                    self._reply(401, {"message": "Unauthorized"})
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                status, answer = fake.route(method, self.path.split("?")[0], body)
                self._reply(status, answer)

            def _reply(self, status: int, answer: Any) -> None:
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                self._serve("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._serve("POST")

            def log_message(self, *args: Any) -> None:  # quiet
                pass

        return Handler
