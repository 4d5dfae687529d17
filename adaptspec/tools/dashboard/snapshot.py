"""PNG snapshots of the key panels, from a Prometheus that scraped a run (matplotlib)."""

from __future__ import annotations

import json
import math
import re
import time
import urllib.parse
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

from adaptspec.tools.dashboard.grafana import substitute
from adaptspec.tools.dashboard.panels import (
    STEPS,
    Dashboard,
    Panel,
    Query,
    class_dashboard,
    overview,
)

# ---------------------------------------------------------------------------------- snapshot


class PrometheusError(RuntimeError):
    """Prometheus could not be queried or answered with an error."""


def prom_get(base: str, path: str, params: dict[str, str], timeout: float = 30.0) -> Any:
    """GET ``base + path`` of Prometheus's HTTP API; returns ``data`` or raises."""
    url = base.rstrip("/") + path + "?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = json.loads(r.read())
    except OSError as e:
        raise PrometheusError(f"{url}: {e}") from None
    if body.get("status") != "success":
        raise PrometheusError(f"{url}: {body.get('errorType')}: {body.get('error')}")
    return body["data"]


def _seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", text.strip())
    if not m:
        raise ValueError(f"not a duration (like 90s, 15m, 2h): {text!r}")
    return float(m.group(1)) * {"ms": 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def _duration(seconds: float) -> str:
    return f"{max(int(math.ceil(seconds)), 1)}s"


def _legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


def _classes(base: str, start: float, end: float) -> list[str]:
    data = prom_get(base, "/api/v1/label/class/values",
                    {"match[]": STEPS, "start": str(start), "end": str(end)})
    return sorted(data)


def _k_label(le: float, les: list[float]) -> str:
    if math.isfinite(le):
        return f"K={int(le - 0.5)}"
    return f"K={int(les[-2] + 0.5)}" if len(les) > 1 else "K"


def _plot_panel(ax: Any, p: Panel, series: list[tuple[Query, dict[str, str], list, list]],
                t0: float) -> None:
    """Draw one panel's series (from query_range) on a matplotlib axis."""
    import numpy as np

    ax.set_title(p.title, fontsize=10, loc="left")
    ax.grid(True, alpha=0.3)
    ax.tick_params(labelsize=8)
    ax.set_xlabel("minutes", fontsize=8)
    if not series:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    if p.kind == "heatmap":
        # cumulative le buckets -> share of request-steps at each K, stacked
        by_le = {float(lab["le"]): (ts, vs) for _, lab, ts, vs in series}
        les = sorted(by_le)
        times = sorted({t for ts, _ in by_le.values() for t in ts})
        col = {t: i for i, t in enumerate(times)}
        grid = np.zeros((len(les), len(times)))
        for r, le in enumerate(les):
            for t, v in zip(*by_le[le], strict=True):
                grid[r, col[t]] = v if math.isfinite(v) else 0.0
        grid = np.diff(np.vstack([np.zeros(len(times)), grid]), axis=0).clip(min=0)
        total = grid.sum(axis=0)
        share = np.divide(grid, total, out=np.full_like(grid, np.nan), where=total > 0) * 100
        ax.stackplot((np.array(times) - t0) / 60, share, labels=[_k_label(le, les) for le in les],
                     colors=[_COLORS[i % len(_COLORS)] for i in range(len(les))], alpha=0.85)
        ax.set_ylim(0, 100)
        ax.set_ylabel("% of request-steps", fontsize=8)
        ax.legend(fontsize=7, loc="lower left", ncol=min(len(les), 6), framealpha=0.8)
        return
    scale = {"percentunit": 100.0, "s": 1000.0}.get(p.unit, 1.0)
    colors: dict[str, str] = {}

    def color(key: str) -> str:
        return colors.setdefault(key, _COLORS[len(colors) % len(_COLORS)])

    stacked: list[tuple[str, Any, Any]] = []
    for q, lab, ts, vs in series:
        name = _legend(q.legend, lab)
        x = (np.array(ts) - t0) / 60
        y = np.array(vs, dtype=float) * scale
        # one colour per class / position / decision: ours solid, vLLM's and estimates dashed
        key = lab.get("class") or lab.get("position") or lab.get("decision") or name
        if p.stack:
            stacked.append((name, x, y))
            continue
        dashed = any(d in name for d in p.dashed)
        ax.plot(x, y, label=name, color=color(key), linewidth=1.6 if not dashed else 1.2,
                linestyle=(0, (4, 2)) if dashed else "-")
    if stacked:
        xs = np.array(sorted({float(t) for _, x, _ in stacked for t in x}))
        ys = [np.interp(xs, x, np.nan_to_num(y), left=0, right=0) for _, x, y in stacked]
        ax.stackplot(xs, ys, labels=[n for n, _, _ in stacked],
                     colors=[color(n) for n, _, _ in stacked], alpha=0.85)
    ylabel = {"percentunit": "%", "ms": "ms", "s": "ms", "ops": "per second"}.get(p.unit, "")
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=8)
    if p.max is not None:
        ax.set_ylim(p.min if p.min is not None else 0, p.max * scale * 1.04)
    elif p.min is not None:
        ax.set_ylim(bottom=p.min * scale)
    ax.legend(fontsize=7, loc="best", ncol=2, framealpha=0.8)


_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf"]


def _titled(p: Panel, cls: str) -> Panel:
    """The panel with ``$class`` in its title and legends replaced (for the PNG)."""
    return replace(p, title=p.title.replace("$class", cls),
                   queries=tuple(replace(q, legend=q.legend.replace("$class", cls))
                                 for q in p.queries))


def snapshot(prometheus: str, out_dir: Path | str, since: str = "15m", step: str | None = None,
             rate_interval: str | None = None, class_name: str | None = None,
             end: float | None = None) -> list[Path]:
    """Render the key panels of both dashboards from Prometheus to PNG files in ``out_dir``.

    One PNG per dashboard (``overview.png``; ``class-<name>.png`` for ``class_name``, or for
    every class Prometheus knows when it is None). ``since`` is the time range ending at
    ``end`` (default: now); ``step`` defaults to range/240 and ``rate_interval`` to
    max(4 * step, 30s), like Grafana's ``$__rate_interval`` for a short scrape interval.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = prometheus.rstrip("/")
    end = time.time() if end is None else end
    rng = _seconds(since)
    start = end - rng
    step_s = _seconds(step) if step else max(rng / 240, 1.0)
    rate_s = _seconds(rate_interval) if rate_interval else max(4 * step_s, 30.0)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    classes = [class_name] if class_name else _classes(base, start, end)
    jobs: list[tuple[str, Dashboard, dict[str, str]]] = [("overview", overview(), {})]
    jobs += [(f"class-{c}", class_dashboard(), {"class": c}) for c in classes]
    written = []
    for name, d, extra in jobs:
        variables = {"__rate_interval": _duration(rate_s), "__range": _duration(rng),
                     "__interval": _duration(step_s), **extra}
        panels = [_titled(p, extra["class"]) if extra else p for p in d.panels() if p.key]
        cols = 2
        rows = math.ceil(len(panels) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(12, 3.1 * rows), squeeze=False)
        for ax, p in zip(axes.flat, panels, strict=False):
            series = []
            for q in p.queries:
                data = prom_get(base, "/api/v1/query_range", {
                    "query": substitute(q.expr, variables), "start": f"{start:.3f}",
                    "end": f"{end:.3f}", "step": f"{step_s:g}"})
                for s in data["result"]:
                    ts = [float(t) for t, _ in s["values"]]
                    vs = [float(v) for _, v in s["values"]]
                    series.append((q, s["metric"], ts, vs))
            _plot_panel(ax, p, series, start)
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        title = d.title + (f": class {extra['class']}" if extra else "")
        fig.suptitle(f"{title}  (last {since}, rate over {_duration(rate_s)})", fontsize=11)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=72)
        plt.close(fig)
        written.append(path)
    return written
