"""The dashboards as Grafana JSON (schema 39), and the queries read back from it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from adaptspec.tools.dashboard.panels import (
    DASHBOARD_FILES,
    DEFAULT_OUT,
    DS,
    STEPS,
    Dashboard,
    Panel,
    dashboards,
)

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
