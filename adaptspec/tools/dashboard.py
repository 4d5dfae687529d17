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

``python -m adaptspec.tools.dashboard generate [--out examples/grafana]`` rewrites the JSON;
``adaptspec dashboard-snapshot --prometheus URL --out DIR`` renders the key panels to PNG from a
Prometheus that scraped a run (matplotlib, extra ``dev``). Standard library only, apart from
matplotlib inside :func:`snapshot`; never imports vLLM.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "examples" / "grafana"
DASHBOARD_FILES = {"overview": "adaptspec-overview.json", "class": "adaptspec-class.json"}
DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"

CLASS_ITL_NOTE = (
    "vLLM's latency histograms have no class label, so these are server-wide: "
    "vllm:inter_token_latency_seconds is the time between two outputs of a request (one per "
    "engine step, however many tokens it carried: with speculation it is the step interval, "
    "not the time per token), and vllm:request_time_per_output_token_seconds is each finished "
    "request's (end - first token) / (tokens - 1). The '$class time per token' line is an "
    "estimate: vLLM's mean inter-token latency divided by the class's tokens per step "
    "(1 + accepted drafts per request-step), i.e. what a request of the class waits per token."
)


# ------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class Query:
    """One PromQL target of a panel."""

    expr: str
    legend: str
    instant: bool = False
    heatmap: bool = False  # Grafana's "heatmap" format: cumulative le buckets -> per bucket


@dataclass(frozen=True)
class Panel:
    """A dashboard panel; ``key`` panels are the ones :func:`snapshot` renders."""

    title: str
    description: str
    queries: tuple[Query, ...]
    kind: str = "timeseries"  # timeseries | heatmap | bargauge | stat
    unit: str = "short"
    width: int = 12
    height: int = 8
    key: bool = False
    stack: bool = False
    min: float | None = None
    max: float | None = None
    dashed: tuple[str, ...] = ()  # legends drawn dashed (vLLM's series, estimates, predictions)


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    rows: tuple[tuple[str, tuple[Panel, ...]], ...]
    class_variable: bool = False
    tags: tuple[str, ...] = ("adaptspec", "vllm", "speculative-decoding")
    extra_links: tuple[str, ...] = field(default_factory=tuple)

    def panels(self) -> list[Panel]:
        return [p for _, panels in self.rows for p in panels]


def _r(metric: str, match: str = "", by: str = "", window: str = RATE) -> str:
    """``sum by (by) (rate(metric{match}[window]))`` (``sum (...)`` when by is empty)."""
    sel = f"{metric}{{{match}}}" if match else metric
    grp = f" by ({by})" if by else ""
    return f"sum{grp} (rate({sel}[{window}]))"


def _fill(expr: str, like: str) -> str:
    """``expr`` with 0 for groups that exist in ``like`` but not in ``expr`` (counters that
    were never incremented for a class, e.g. accepted drafts of a latency-critical class)."""
    return f"({expr} or 0 * {like})"


# --------------------------------------------------------------------------------- overview

STEPS = "adaptspec_steps_total"
DRAFT = "adaptspec_draft_tokens_total"
ACC = "adaptspec_accepted_tokens_total"
ACC_POS = "adaptspec_accepted_tokens_per_pos_total"
DRAFT_POS = "adaptspec_draft_tokens_per_pos_total"
K_BUCKET, K_SUM, K_COUNT = "adaptspec_chosen_k_bucket", "adaptspec_chosen_k_sum", \
    "adaptspec_chosen_k_count"
ESTIMATE = "adaptspec_acceptance_estimate"
ERRORS = "adaptspec_controller_errors_total"
STEP_MS = "adaptspec_step_time_ms"
V_DRAFTS = "vllm:spec_decode_num_drafts_total"
V_DRAFT_TOK = "vllm:spec_decode_num_draft_tokens_total"
V_ACC = "vllm:spec_decode_num_accepted_tokens_total"
V_ACC_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
V_ITL = "vllm:inter_token_latency_seconds_bucket"
V_ITL_SUM, V_ITL_COUNT = "vllm:inter_token_latency_seconds_sum", \
    "vllm:inter_token_latency_seconds_count"
V_TPOT_SUM, V_TPOT_COUNT = "vllm:request_time_per_output_token_seconds_sum", \
    "vllm:request_time_per_output_token_seconds_count"
V_RUNNING = "vllm:num_requests_running"
SPEC = 'decision="speculate"'
NOT_LC = 'decision!="latency_critical"'

VLLM_ACCEPTANCE = f"{_r(V_ACC)} / {_r(V_DRAFT_TOK)}"
VLLM_TOKENS_PER_STEP = f"1 + {_r(V_ACC)} / {_r(V_DRAFTS)}"


def _class_match(cls: bool) -> str:
    return 'class=~"$class"' if cls else ""


def overview() -> Dashboard:
    steps_by_class = _r(STEPS, by="class")
    acceptance = Panel(
        "Acceptance per class",
        "Share of verified draft tokens the target accepted, per class (solid), the controller's "
        "posterior estimate for draft position 0 (adaptspec_acceptance_estimate, dotted), and "
        "vLLM's own server-wide acceptance from vllm:spec_decode_* (dashed). Classes the "
        "controller never drafts for (latency-critical) have no line.",
        (
            Query(f"{_r(ACC, by='class')} / {_r(DRAFT, by='class')}", "{{class}}"),
            Query(f"max by (class) ({ESTIMATE})", "{{class}} estimate (pos 0)"),
            Query(VLLM_ACCEPTANCE, "vLLM (all requests)"),
        ),
        unit="percentunit", key=True, min=0, max=1,
        dashed=("vLLM (all requests)", "estimate"),
    )
    tokens_per_step = Panel(
        "Tokens per step",
        "Tokens a request gets per engine step it is in: 1 + accepted drafts per request-step, "
        "per class (plain and latency-critical steps count as 1). vLLM's mean acceptance length "
        "(1 + accepted / drafts, dashed) counts only steps that speculated.",
        (
            Query(f"1 + {_fill(_r(ACC, by='class'), steps_by_class)} / {steps_by_class}",
                  "{{class}}"),
            Query(VLLM_TOKENS_PER_STEP, "vLLM mean acceptance length"),
        ),
        key=True, min=1, dashed=("vLLM mean acceptance length",),
    )
    k_dist = Panel(
        "Chosen K distribution",
        "How often each K was chosen per request-step (all classes), from the "
        "adaptspec_chosen_k histogram: bucket le=0.5 is K = 0, le=1.5 is K = 1, and so on.",
        (Query(f"sum by (le) (rate({K_BUCKET}[{RATE}]))", "{{le}}", heatmap=True),),
        kind="heatmap", key=True,
    )
    mean_k = Panel(
        "Mean K per class",
        "Mean chosen K per request-step, per class (adaptspec_chosen_k_sum / _count), beside "
        "vLLM's draft tokens per draft (the K it actually verified, over speculating "
        "requests only).",
        (
            Query(f"{_r(K_SUM, by='class')} / {_r(K_COUNT, by='class')}", "{{class}}"),
            Query(f"{_r(V_DRAFT_TOK)} / {_r(V_DRAFTS)}", "vLLM draft tokens per draft"),
        ),
        min=0, dashed=("vLLM draft tokens per draft",),
    )
    decisions = Panel(
        "Decisions by type",
        "Per-request decisions per second, stacked: speculate (K > 0), plain (K = 0 because "
        "speculation would cost more than it saves), latency_critical (class never "
        "speculates), fallback (controller fault: the policy's fallback_k).",
        (Query(_r(STEPS, by="decision"), "{{decision}}"),),
        unit="ops", stack=True, key=True, min=0,
    )
    share = Panel(
        "Share of steps speculated",
        "Per class: request-steps with K > 0 over all request-steps of the class. 'all "
        "speculable' leaves latency-critical steps out of the denominator: it falling to 0 "
        "under load means the cost model turned speculation off (expected when the batch is "
        "compute-bound; see the alert SpeculationStoppedUnderLoad).",
        (
            Query(f"{_fill(_r(STEPS, SPEC, 'class'), steps_by_class)} / "
                  f"{steps_by_class}", "{{class}}"),
            Query(f"({_r(STEPS, SPEC)} or vector(0)) / "
                  f"{_r(STEPS, NOT_LC)}", "all speculable"),
        ),
        unit="percentunit", key=True, min=0, max=1, dashed=("all speculable",),
    )
    errors = Panel(
        "Controller errors",
        "Controller faults absorbed per interval (adaptspec_controller_errors_total); each "
        "one gave the affected step the policy's fallback_k. Should stay at 0.",
        (
            Query(f"sum (increase({ERRORS}[{RATE}]))", "errors"),
            Query(_r(STEPS, 'decision="fallback"'), "fallback decisions / s"),
        ),
        min=0,
    )
    errors_total = Panel(
        "Controller errors (range)",
        "Controller faults over the dashboard's time range.",
        (Query(f"sum (increase({ERRORS}[$__range]))", "errors", instant=True),),
        kind="stat", width=4,
    )
    step_time = Panel(
        "Step time: predicted vs measured",
        "The controller's cost model prediction for the step it chose (predicted, dashed) and "
        "the measured time of the last pure-decode step (measured). Gauges of the last step, "
        "sampled at each scrape; a lasting gap means the cost model needs learning "
        "(cost_model.learn) or a different preset.",
        (
            Query(f'max by (kind) ({STEP_MS}{{kind="measured"}})', "measured"),
            Query(f'max by (kind) ({STEP_MS}{{kind="predicted"}})', "predicted"),
        ),
        unit="ms", key=True, min=0, dashed=("predicted",), width=20,
    )
    vllm_raw = Panel(
        "vLLM spec decode throughput",
        "vLLM's own counters, for cross-checking ours: drafts, draft tokens and accepted "
        "tokens per second (all requests), and our draft / accepted tokens (all classes). "
        "They agree, except that steps whose controller call failed are missing from ours.",
        (
            Query(_r(V_DRAFTS), "vLLM drafts / s"),
            Query(_r(V_DRAFT_TOK), "vLLM draft tokens / s"),
            Query(_r(V_ACC), "vLLM accepted tokens / s"),
            Query(_r(DRAFT), "adaptspec draft tokens / s"),
            Query(_r(ACC), "adaptspec accepted tokens / s"),
        ),
        unit="ops", min=0, width=24,
        dashed=("vLLM drafts / s", "vLLM draft tokens / s", "vLLM accepted tokens / s"),
    )
    return Dashboard(
        uid="adaptspec-overview",
        title="adaptspec overview",
        description="Adaptive speculative decoding (adaptspec) beside vLLM's spec decode metrics.",
        rows=(
            ("Acceptance", (acceptance, tokens_per_step)),
            ("Draft length", (k_dist, mean_k)),
            ("Decisions", (decisions, share)),
            ("Cost and faults", (step_time, errors_total, errors, vllm_raw)),
        ),
    )


def class_dashboard() -> Dashboard:
    m = 'class="$class"'
    steps = _r(STEPS, m)
    per_pos = Panel(
        "Acceptance per draft position",
        "Conditional acceptance at draft position j for $class: accepted at j / drafted at j "
        "(a draft at j is verified only if all before it were accepted). vLLM's per-position "
        "series (dashed) is server-wide and divided by its number of drafts, so it is the "
        "unconditional rate of reaching and accepting position j.",
        (
            Query(f"{_fill(_r(ACC_POS, m, 'position'), _r(DRAFT_POS, m, 'position'))} / "
                  f"{_r(DRAFT_POS, m, 'position')}", "position {{position}}"),
            Query(f"{_r(V_ACC_POS, by='position')} / scalar({_r(V_DRAFTS)})",
                  "vLLM position {{position}}"),
        ),
        unit="percentunit", key=True, min=0, max=1, dashed=("vLLM position",),
    )
    per_pos_bar = Panel(
        "Acceptance per draft position (time range)",
        "The same ratio over the dashboard's time range.",
        (Query(f"sum by (position) (increase({ACC_POS}{{{m}}}[$__range])) / "
               f"sum by (position) (increase({DRAFT_POS}{{{m}}}[$__range]))",
               "{{position}}", instant=True),),
        kind="bargauge", unit="percentunit", min=0, max=1,
    )
    k_time = Panel(
        "K over time",
        "Mean chosen K per request-step of $class (adaptspec_chosen_k_sum / _count, K = 0 "
        "steps included) beside vLLM's draft tokens per draft (all classes, speculating "
        "requests only).",
        (
            Query(f"{_r(K_SUM, m)} / {_r(K_COUNT, m)}", "mean K"),
            Query(f"{_r(V_DRAFT_TOK)} / {_r(V_DRAFTS)}", "vLLM draft tokens per draft"),
        ),
        key=True, min=0, dashed=("vLLM",),
    )
    k_dist = Panel(
        "K distribution",
        "How often each K was chosen for $class (bucket le=0.5 is K = 0, le=1.5 is K = 1, ...; "
        "the +Inf bucket is K = k_max).",
        (Query(f"sum by (le) (rate({K_BUCKET}{{{m}}}[{RATE}]))", "{{le}}", heatmap=True),),
        kind="heatmap", key=True,
    )
    acc_time = Panel(
        "Acceptance and estimate",
        "Measured acceptance of $class (accepted / drafted) beside the controller's posterior "
        "mean for position 0.",
        (
            Query(f"{_r(ACC, m)} / {_r(DRAFT, m)}", "measured"),
            Query(f"max by (class) ({ESTIMATE}{{{m}}})", "estimate (pos 0)"),
        ),
        unit="percentunit", min=0, max=1, dashed=("estimate (pos 0)",),
    )
    decisions = Panel(
        "Decisions",
        "Per-request decisions of $class per second, stacked.",
        (Query(_r(STEPS, m, "decision"), "{{decision}}"),),
        unit="ops", stack=True, min=0,
    )
    tokens = Panel(
        "Tokens per step",
        "1 + accepted drafts per request-step of $class.",
        (Query(f"1 + {_fill(_r(ACC, m), steps)} / {steps}", "tokens per step"),),
        min=1,
    )
    itl = Panel(
        "Inter-token latency",
        CLASS_ITL_NOTE,
        (
            Query(f"histogram_quantile(0.5, {_r(V_ITL, by='le')})", "vLLM p50 (all classes)"),
            Query(f"histogram_quantile(0.99, {_r(V_ITL, by='le')})", "vLLM p99 (all classes)"),
            Query(f"{_r(V_TPOT_SUM)} / {_r(V_TPOT_COUNT)}",
                  "vLLM time per output token (all classes)"),
            Query(f"({_r(V_ITL_SUM)} / {_r(V_ITL_COUNT)}) / scalar(1 + "
                  f"{_fill(_r(ACC, m), steps)} / {steps})", "$class time per token (estimate)"),
        ),
        unit="s", key=True, min=0, width=12, dashed=("estimate",),
    )
    return Dashboard(
        uid="adaptspec-class",
        title="adaptspec class",
        description="One adaptspec request class: per-position acceptance, K, latency.",
        rows=(
            ("Acceptance", (per_pos, per_pos_bar)),
            ("Draft length", (k_time, k_dist)),
            ("Throughput and latency", (acc_time, tokens, decisions, itl)),
        ),
        class_variable=True,
    )


def dashboards() -> dict[str, Dashboard]:
    return {"overview": overview(), "class": class_dashboard()}


# ------------------------------------------------------------------------------ Grafana JSON


def _panel_json(p: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    targets = []
    for i, q in enumerate(p.queries):
        t: dict[str, Any] = {
            "datasource": DS, "expr": q.expr, "legendFormat": q.legend, "refId": chr(65 + i),
            "range": not q.instant, "instant": q.instant, "editorMode": "code",
        }
        if q.heatmap:
            t["format"] = "heatmap"
        targets.append(t)
    defaults: dict[str, Any] = {"unit": p.unit}
    if p.min is not None:
        defaults["min"] = p.min
    if p.max is not None:
        defaults["max"] = p.max
    overrides = [
        {"matcher": {"id": "byRegexp", "options": f".*{re.escape(name)}.*"},
         "properties": [{"id": "custom.lineStyle",
                         "value": {"fill": "dash", "dash": [10, 10]}}]}
        for name in p.dashed
    ]
    out: dict[str, Any] = {
        "id": pid, "type": p.kind, "title": p.title, "description": p.description,
        "datasource": DS, "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
        "targets": targets, "fieldConfig": {"defaults": defaults, "overrides": overrides},
    }
    if p.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line", "lineWidth": 1, "fillOpacity": 20 if p.stack else 0,
            "showPoints": "never", "spanNulls": False,
            "stacking": {"mode": "normal" if p.stack else "none", "group": "A"},
        }
        out["options"] = {"legend": {"displayMode": "list", "placement": "bottom"},
                          "tooltip": {"mode": "multi", "sort": "desc"}}
    elif p.kind == "heatmap":
        out["options"] = {
            "calculate": False, "yAxis": {"axisLabel": "K (bucket upper bound)"},
            "cellGap": 1, "color": {"mode": "scheme", "scheme": "Blues", "steps": 64},
            "rowsFrame": {"layout": "le"}, "tooltip": {"show": True, "yHistogram": True},
        }
    elif p.kind == "bargauge":
        out["options"] = {"orientation": "vertical", "displayMode": "basic",
                          "reduceOptions": {"calcs": ["lastNotNull"], "values": False}}
    elif p.kind == "stat":
        out["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "values": False},
                          "colorMode": "value", "graphMode": "none"}
        defaults["thresholds"] = {"mode": "absolute", "steps": [
            {"color": "green", "value": None}, {"color": "red", "value": 1}]}
    return out


def to_grafana(d: Dashboard) -> dict[str, Any]:
    """The dashboard as Grafana JSON (what Grafana's import and file provisioning read)."""
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for row_title, row in d.rows:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y, x, row_h = pid + 1, y + 1, 0, 0
        for p in row:
            if x + p.width > 24:
                x, y, row_h = 0, y + row_h, 0
            panels.append(_panel_json(p, pid, x, y))
            pid, x, row_h = pid + 1, x + p.width, max(row_h, p.height)
        y += row_h
    variables: list[dict[str, Any]] = [{
        "name": "datasource", "label": "Prometheus", "type": "datasource",
        "query": "prometheus", "current": {}, "hide": 0, "refresh": 1, "options": [],
    }]
    if d.class_variable:
        variables.append({
            "name": "class", "label": "class", "type": "query", "datasource": DS,
            "query": {"query": f"label_values({STEPS}, class)", "refId": "classes"},
            "definition": f"label_values({STEPS}, class)", "refresh": 2, "sort": 1,
            "multi": False, "includeAll": False, "current": {}, "hide": 0, "options": [],
        })
    return {
        "uid": d.uid, "title": d.title, "description": d.description, "tags": list(d.tags),
        "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1,
        "time": {"from": "now-30m", "to": "now"}, "refresh": "10s", "timezone": "",
        "templating": {"list": variables}, "annotations": {"list": []},
        "links": [{"title": "adaptspec dashboards", "type": "dashboards", "tags": ["adaptspec"],
                   "asDropdown": False, "includeVars": False, "keepTime": True}],
        "panels": panels,
    }


def render_json(d: Dashboard) -> str:
    return json.dumps(to_grafana(d), indent=2) + "\n"


def write_dashboards(out_dir: Path | str = DEFAULT_OUT) -> list[Path]:
    """Write every dashboard's JSON into ``out_dir``; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, d in dashboards().items():
        path = out / DASHBOARD_FILES[name]
        path.write_text(render_json(d))
        paths.append(path)
    return paths


def grafana_queries(dashboard_json: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every target in a Grafana dashboard JSON (rows included)."""
    out: list[tuple[str, str]] = []
    stack = list(dashboard_json.get("panels", []))
    while stack:
        p = stack.pop(0)
        stack.extend(p.get("panels", []))
        for t in p.get("targets", []):
            out.append((p.get("title", ""), t["expr"]))
    return out


def substitute(expr: str, variables: dict[str, str]) -> str:
    """Grafana-style ``$name`` / ``${name}`` substitution (longest names first)."""
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", variables[name]).replace("$" + name,
                                                                          variables[name])
    left = re.findall(r"\$\{?\w+", expr)
    if left:
        raise ValueError(f"unsubstituted variables {left} in {expr!r}")
    return expr


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


# ------------------------------------------------------------------------------ command line


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


if __name__ == "__main__":
    sys.exit(main())
