"""`tokenflow dashboards push`: create or update the dashboards in a Grafana, with grafana-client.

Idempotent: each dashboard keeps its uid (`tokenflow.ops.dashboards.DASHBOARDS`) and is
saved with `overwrite: true`, so a second push updates the same dashboards (Grafana bumps their
version) instead of adding copies. They go into one folder, created on the first push.

grafana-client depends on `urllib3-future`, whose wheel replaces the `urllib3` package of the
environment it is installed into; the Makefile installs it with `URLLIB3_NO_OVERRIDE=1` and
`--no-binary urllib3-future` so that `requests` keeps the real urllib3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenflow.ops.dashboards import dashboards

DEFAULT_FOLDER = "tokenflow"


@dataclass(frozen=True)
class Pushed:
    """One dashboard as Grafana answered its save: uid, URL path and new version."""

    uid: str
    url: str
    version: int


def push(url: str, token: str | None, folder: str = DEFAULT_FOLDER,
         timeout_s: float = 10.0) -> list[Pushed]:
    """Create or update every tokenflow dashboard in the Grafana at `url`.

    `token` is a service-account token (sent as a bearer token); None uses the user and
    password in the URL (`http://admin:admin@host:3000`), as grafana-client does.
    """
    from grafana_client import GrafanaApi

    api = GrafanaApi.from_url(url, credential=token, timeout=timeout_s)
    folder_uid = _ensure_folder(api, folder)
    pushed = []
    for model in dashboards().values():
        # id None: Grafana finds the dashboard by uid, so the same uid updates in place.
        answer = api.dashboard.update_dashboard({
            "dashboard": {**model, "id": None}, "folderUid": folder_uid, "overwrite": True,
            "message": "tokenflow dashboards push"})
        pushed.append(Pushed(answer["uid"], answer.get("url", ""), int(answer["version"])))
    return pushed


def _ensure_folder(api: Any, title: str) -> str:
    """The uid of the folder titled `title` (its uid is derived from it); created if missing."""
    from grafana_client.client import GrafanaClientError

    uid = "".join(c if c.isalnum() else "-" for c in title.lower())[:40]  # Grafana: <= 40
    try:
        return str(api.folder.get_folder(uid)["uid"])
    except GrafanaClientError as err:
        if err.status_code != 404:
            raise
    return str(api.folder.create_folder(title, uid=uid)["uid"])
