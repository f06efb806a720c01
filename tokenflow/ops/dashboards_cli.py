"""`tokenflow dashboards render DIR` and `tokenflow dashboards push --url URL --token TOKEN`."""

from __future__ import annotations

import argparse
import os
import sys

from tokenflow.ops.grafana import DEFAULT_FOLDER


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the `dashboards` command and its two actions to the tokenflow CLI."""
    p = sub.add_parser("dashboards", help="the Grafana dashboards: write their JSON or push them")
    actions = p.add_subparsers(dest="action", required=True)
    render = actions.add_parser("render", help="write every dashboard's JSON into DIR")
    render.add_argument("directory", help="output directory (created if missing)")
    render.set_defaults(func=_render)
    push = actions.add_parser("push", help="create or update the dashboards in a Grafana")
    push.add_argument("--url", default=os.environ.get("GRAFANA_URL"),
                      help="Grafana's URL (default: $GRAFANA_URL)")
    push.add_argument("--token", default=os.environ.get("GRAFANA_TOKEN"),
                      help="a service-account token (default: $GRAFANA_TOKEN; without one, "
                           "the user:password in the URL)")
    push.add_argument("--folder", default=DEFAULT_FOLDER, help="folder title (default: %(default)s)")
    push.set_defaults(func=_push)


def _render(args: argparse.Namespace) -> int:
    from tokenflow.ops.dashboards import render

    for path in render(args.directory):
        print(path)
    return 0


def _push(args: argparse.Namespace) -> int:
    from grafana_client.client import GrafanaException
    from niquests.exceptions import RequestException

    from tokenflow.ops.grafana import push

    if not args.url:
        raise ValueError("give --url (or set GRAFANA_URL)")
    try:
        pushed = push(args.url, args.token, args.folder)
    except (GrafanaException, RequestException) as exc:
        print(f"error: Grafana at {args.url}: {exc}", file=sys.stderr)
        return 1
    for item in pushed:
        print(f"{item.uid}: version {item.version} {args.url.rstrip('/')}{item.url}")
    return 0
