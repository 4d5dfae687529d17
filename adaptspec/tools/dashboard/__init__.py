"""Grafana dashboards for adaptspec, generated from code, and PNG snapshots of their key panels.

Two dashboards, plain Grafana JSON (schema 39, Grafana 10/11), committed under
``examples/grafana/``:

* ``adaptspec-overview.json``: acceptance per class over time, tokens per step, the chosen-K
  distribution, decisions by type, share of steps speculated, controller errors, predicted vs
  measured step time, each beside vLLM's own ``vllm:spec_decode_*`` series where one exists;
* ``adaptspec-class.json``: templated by ``$class``: acceptance per draft position, K over
  time, decisions, and inter-token latency (vLLM's ITL histogram is server-wide, not per class:
  the per-class line is an estimate, see :data:`CLASS_ITL_NOTE`).

Every panel's PromQL is written for the ``/metrics`` of ``adaptspec serve``: prometheus-client
multiprocess mode sums counters and histograms over processes; the two gauges use
``mostrecent`` (no ``pid`` label), but are still wrapped in ``max by (...)`` so a deployment with
another ``multiprocess_mode`` (which adds ``pid``) gets one line per class, not one per process.

Panels as data in ``panels.py``, their Grafana JSON in ``grafana.py``, PNG snapshots from a
Prometheus in ``snapshot.py``.

``python -m adaptspec.tools.dashboard generate [--out examples/grafana]`` rewrites the JSON;
``adaptspec dashboard-snapshot --prometheus URL --out DIR`` renders the key panels to PNG from a
Prometheus that scraped a run (matplotlib, extra ``dev``). Standard library only, apart from
matplotlib inside :func:`snapshot`; never imports vLLM.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence

from adaptspec.tools.dashboard.grafana import (  # noqa: F401
    grafana_queries,
    render_json,
    substitute,
    to_grafana,
    write_dashboards,
)
from adaptspec.tools.dashboard.panels import (  # noqa: F401
    DASHBOARD_FILES,
    DEFAULT_OUT,
    dashboards,
)
from adaptspec.tools.dashboard.snapshot import PrometheusError, prom_get, snapshot  # noqa: F401


def snapshot_main(args: argparse.Namespace) -> int:
    """``adaptspec dashboard-snapshot``."""
    try:
        paths = snapshot(args.prometheus, args.out, since=args.since, step=args.step,
                         rate_interval=args.rate_interval, class_name=args.class_name,
                         end=args.end)
    except (PrometheusError, ValueError) as e:
        print(f"adaptspec dashboard-snapshot: {e}", file=sys.stderr)
        return 1
    for p in paths:
        print(f"wrote {p}")
    return 0


def add_snapshot_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--prometheus", required=True,
                    help="Prometheus base URL, e.g. http://127.0.0.1:9090")
    ap.add_argument("--out", required=True, help="folder for the PNG files")
    ap.add_argument("--since", default="15m", help="time range ending at --end (default 15m)")
    ap.add_argument("--end", type=float, default=None,
                    help="end of the time range, Unix seconds (default: now)")
    ap.add_argument("--step", default=None, help="query resolution (default range/240)")
    ap.add_argument("--rate-interval", default=None,
                    help="window for rate() (default max(4*step, 30s))")
    ap.add_argument("--class", dest="class_name", default=None,
                    help="render the class dashboard for this class only (default: every class)")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m adaptspec.tools.dashboard", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="write the dashboards' Grafana JSON")
    gen.add_argument("--out", default=str(DEFAULT_OUT))
    snap = sub.add_parser("snapshot", help="render key panels to PNG (= adaptspec "
                                           "dashboard-snapshot)")
    add_snapshot_arguments(snap)
    args = ap.parse_args(argv)
    if args.command == "generate":
        for p in write_dashboards(args.out):
            print(f"wrote {p}")
        return 0
    return snapshot_main(args)


def all_exprs(names: Iterable[str] | None = None) -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expr) of every query of the generated dashboards."""
    ds = dashboards()
    return [(n, t, e) for n in (names or ds) for t, e in grafana_queries(to_grafana(ds[n]))]
