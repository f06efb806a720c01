"""`tokenflow serve`'s observability flags, as Ray will get them (no cluster started here)."""

from __future__ import annotations

import argparse
import os
import socket

import pytest

from tokenflow.cli import main
from tokenflow.ops.observe import ObserveOptions, add_arguments, options_from_args


def _parse(*flags: str) -> ObserveOptions:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return options_from_args(parser.parse_args(list(flags)))


def test_dashboard_is_on_by_default_on_loopback() -> None:
    # No port: Ray takes 8265, or the next free one when another dashboard holds it.
    options = _parse()
    assert options.ray_init_kwargs() == {"include_dashboard": True, "dashboard_host": "127.0.0.1"}
    assert options.env == ()
    assert _parse("--dashboard-port", "8300").ray_init_kwargs()["dashboard_port"] == 8300


def test_no_dashboard_and_a_fixed_metrics_port() -> None:
    options = _parse("--no-dashboard", "--metrics-port", "9100")
    assert options.ray_init_kwargs() == {"include_dashboard": False,
                                         "_metrics_export_port": 9100}


def test_prometheus_and_grafana_flags_become_rays_variables(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RAY_PROMETHEUS_HOST", "RAY_GRAFANA_HOST", "RAY_GRAFANA_IFRAME_HOST"):
        monkeypatch.delenv(name, raising=False)
    options = _parse("--prometheus-host", "http://127.0.0.1:9090",
                     "--grafana-host", "http://grafana:3000")
    options.export_env()
    assert os.environ["RAY_PROMETHEUS_HOST"] == "http://127.0.0.1:9090"
    assert os.environ["RAY_GRAFANA_HOST"] == "http://grafana:3000"
    assert "RAY_GRAFANA_IFRAME_HOST" not in os.environ  # not given, not set


def test_a_taken_metrics_port_is_named() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"127.0.0.1:{port}.*--metrics-port"):
            _parse("--no-dashboard", "--metrics-port", str(port)).check_ports_free()


def test_serve_help_lists_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--dashboard-port", "--no-dashboard", "--metrics-port", "--prometheus-host",
                 "--grafana-host"):
        assert flag in out
