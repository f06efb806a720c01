"""The Grafana dashboards: every metric on a panel, well-formed models, render and push.

`push` is tested against `FakeGrafana`, a loopback server implementing the few Grafana HTTP API
routes the client calls (no Grafana server can run here); the real grafana-client talks to it.
Whether each panel's query returns data is tested against a real Prometheus in
test_prometheus.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.fake_grafana import FakeGrafana
from tokenflow.cli import main
from tokenflow.cluster.metrics import ServerMetrics
from tokenflow.ops.dashboards import DASHBOARDS, PANELS, dashboard, dashboards, expand
from tokenflow.ops.grafana import push

TOKEN = "glsa_test_token"


def _exprs() -> list[str]:
    return [q.expr for p in PANELS for q in p.queries]


def test_every_tokenflow_metric_is_on_a_panel() -> None:
    """A metric added to ServerMetrics without a panel fails here."""
    names = ServerMetrics("m").names
    assert names
    for name in names:
        pattern = re.compile(rf"\bray_{name}(_total|_bucket|_sum|_count)?\b")
        assert any(pattern.search(e) for e in _exprs()), f"{name} is on no dashboard panel"


def test_each_dashboard_has_panels_datasource_and_filters() -> None:
    assert {p.dashboard for p in PANELS} == set(DASHBOARDS)
    for name, (uid, _) in DASHBOARDS.items():
        model = dashboard(name)
        assert model["uid"] == uid
        variables = {v["name"]: v for v in model["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        assert variables["replica"]["includeAll"] and variables["replica"]["allValue"] == ".*"
        ids = [p["id"] for p in model["panels"]]
        assert len(ids) == len(set(ids)) and ids
        for panel in model["panels"]:
            assert panel["datasource"]["uid"] == "${datasource}"
            assert panel["targets"] and all(t["expr"] for t in panel["targets"])


def test_tokenflow_queries_filter_by_replica() -> None:
    for expr in _exprs():
        for selector in re.findall(r"ray_tokenflow_\w+(\{[^}]*\})", expr):
            assert 'replica=~"$replica"' in selector, expr
        assert "$" not in expand(expr), expr


def test_render_writes_one_json_per_dashboard(tmp_path: Path) -> None:
    assert main(["dashboards", "render", str(tmp_path / "out")]) == 0
    written = {p.name: json.loads(p.read_text()) for p in (tmp_path / "out").iterdir()}
    assert written == dashboards()


@pytest.fixture()
def grafana() -> Iterator[FakeGrafana]:
    fake = FakeGrafana(TOKEN)
    try:
        yield fake
    finally:
        fake.stop()


def test_push_creates_then_updates_the_same_dashboards(grafana: FakeGrafana) -> None:
    first = push(grafana.url, TOKEN)
    assert sorted(p.uid for p in first) == sorted(uid for uid, _ in DASHBOARDS.values())
    assert {p.version for p in first} == {1}
    assert list(grafana.folders) == ["tokenflow"]
    second = push(grafana.url, TOKEN)
    assert [p.uid for p in second] == [p.uid for p in first]
    assert {p.version for p in second} == {2}
    assert len(grafana.dashboards) == len(DASHBOARDS)
    assert grafana.requests.count(("POST", "/api/folders")) == 1
    for model in dashboards().values():
        saved = grafana.dashboards[model["uid"]]
        assert saved["folderUid"] == "tokenflow"
        assert {k: v for k, v in saved["dashboard"].items() if k not in ("id", "version")} == {
            k: v for k, v in model.items() if k not in ("id", "version")}


def test_push_cli_reports_a_refused_token(grafana: FakeGrafana,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dashboards", "push", "--url", grafana.url, "--token", "wrong"]) == 1
    assert "Unauthorized" in capsys.readouterr().err
    assert main(["dashboards", "push", "--url", grafana.url, "--token", TOKEN]) == 0
    assert "tokenflow-overview: version 1" in capsys.readouterr().out
