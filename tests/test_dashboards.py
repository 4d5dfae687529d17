"""The Grafana dashboards, the Prometheus config and the alerts, checked statically: the committed
dashboards are the generated ones and hold what Grafana needs; `promtool` accepts the alert rules
and the scrape config, and each alert fires on the synthetic series it is for, and only then.
Against a real Prometheus scraping a real server: test_dashboards_live.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from prom_setup import ALERTS, EXAMPLES, PROMTOOL, SCRAPE_CONFIG

from adaptspec.tools import dashboard as dash

needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (`make test-deps`, part of `make test`, "
                             "installs Debian's prometheus package where apt-get can)")


# ------------------------------------------------------------------- generated JSON, statically


@pytest.mark.parametrize("name", sorted(dash.DASHBOARD_FILES))
def test_committed_dashboards_are_the_generated_ones(name: str) -> None:
    path = EXAMPLES / "grafana" / dash.DASHBOARD_FILES[name]
    assert path.read_text() == dash.render_json(dash.dashboards()[name]), (
        f"{path} is stale: run `python -m adaptspec.tools.dashboard generate`")


def test_dashboards_have_the_panels_grafana_needs() -> None:
    overview = json.loads((EXAMPLES / "grafana" / "adaptspec-overview.json").read_text())
    klass = json.loads((EXAMPLES / "grafana" / "adaptspec-class.json").read_text())
    for d in (overview, klass):
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids))
        for p in d["panels"]:
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24 and g["h"] > 0
            if p["type"] == "row":
                continue
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            refs = [t["refId"] for t in p["targets"]]
            assert refs and len(refs) == len(set(refs)) and p["description"]
    titles = {p["title"] for p in overview["panels"]}
    assert {"Acceptance per class", "Tokens per step", "Chosen K distribution",
            "Decisions by type", "Share of steps speculated", "Controller errors",
            "Step time: predicted vs measured"} <= titles
    assert {"Acceptance per draft position", "K over time", "Inter-token latency"} <= {
        p["title"] for p in klass["panels"]}
    assert [v["name"] for v in klass["templating"]["list"]] == ["datasource", "class"]
    exprs = " ".join(e for _, e in dash.grafana_queries(overview) + dash.grafana_queries(klass))
    for series in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                   "vllm:spec_decode_num_accepted_tokens_total",
                   "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                   "vllm:inter_token_latency_seconds_bucket"):
        assert series in exprs, series


def test_substitute_leaves_no_variable_behind() -> None:
    assert dash.substitute('rate(x{class="$class"}[$__rate_interval])',
                           {"class": "code", "__rate_interval": "30s"}) == \
        'rate(x{class="code"}[30s])'
    with pytest.raises(ValueError, match="unsubstituted"):
        dash.substitute("rate(x[$__range])", {"__rate_interval": "30s"})


# -------------------------------------------------------------------------- alerts, promtool


@needs_promtool
def test_alert_rules_and_scrape_config_pass_promtool() -> None:
    for args in (["check", "rules", str(ALERTS)], ["check", "config", str(SCRAPE_CONFIG)]):
        proc = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def _annotations(alert: str, **labels: str) -> dict[str, str]:
    """An alert's annotations with {{ $labels.x }} filled in, as Prometheus renders them."""
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    rule = next(r for r in rules if r["alert"] == alert)
    out = {}
    for k, v in rule["annotations"].items():
        for name, value in labels.items():
            v = v.replace("{{ $labels." + name + " }}", value)
        out[k] = v
    return out


@needs_promtool
def test_alerts_fire_on_synthetic_series(tmp_path: Path) -> None:
    """`promtool test rules`: each alert fires on the pattern it is for, and only then."""
    inst = {"job": "vllm", "instance": "a:8000"}
    sel = ",".join(f'{k}="{v}"' for k, v in inst.items())
    tests = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [
            {   # code: 80% acceptance for 7 h, then 5% for the last 40 min; chat steady at 60%
                "interval": "1m",
                "input_series": [
                    {"series": f'adaptspec_draft_tokens_total{{{sel},class="code"}}',
                     "values": "0+600x500"},
                    {"series": f'adaptspec_accepted_tokens_total{{{sel},class="code"}}',
                     "values": "0+480x420 201600+30x80"},
                    {"series": f'adaptspec_draft_tokens_total{{{sel},class="chat"}}',
                     "values": "0+600x500"},
                    {"series": f'adaptspec_accepted_tokens_total{{{sel},class="chat"}}',
                     "values": "0+360x500"},
                ],
                "alert_rule_test": [
                    {"eval_time": "6h", "alertname": "AdaptspecAcceptanceCollapse",
                     "exp_alerts": []},
                    {"eval_time": "7h40m", "alertname": "AdaptspecAcceptanceCollapse",
                     "exp_alerts": [{
                         "exp_labels": {**inst, "class": "code", "severity": "warning"},
                         "exp_annotations": _annotations("AdaptspecAcceptanceCollapse",
                                                         **inst, **{"class": "code"})}]},
                    {"eval_time": "7h40m", "alertname": "AdaptspecAcceptanceVeryLow",
                     "exp_alerts": [{
                         "exp_labels": {**inst, "class": "code", "severity": "warning"},
                         "exp_annotations": _annotations("AdaptspecAcceptanceVeryLow",
                                                         **inst, **{"class": "code"})}]},
                ],
            },
            {   # errors stop after 10 min; speculation stops at 30 min under 6 running requests
                "interval": "1m",
                "input_series": [
                    {"series": f"adaptspec_controller_errors_total{{{sel}}}",
                     "values": "0+2x10 20x60"},
                    {"series": f'adaptspec_steps_total{{{sel},class="code",decision="speculate"}}',
                     "values": "0+100x30 3000x40"},
                    {"series": f'adaptspec_steps_total{{{sel},class="code",decision="plain"}}',
                     "values": "0+10x30 300+110x40"},
                    {"series": f'adaptspec_steps_total{{{sel},class="chat",'
                               f'decision="latency_critical"}}',
                     "values": "0+50x70"},
                    {"series": f"vllm:num_requests_running{{{sel},engine=\"0\"}}",
                     "values": "6x70"},
                    {"series": f"up{{{sel}}}", "values": "1x70"},
                ],
                "alert_rule_test": [
                    {"eval_time": "5m", "alertname": "AdaptspecControllerErrors",
                     "exp_alerts": [{"exp_labels": {**inst, "severity": "warning"},
                                     "exp_annotations": _annotations(
                                         "AdaptspecControllerErrors", **inst)}]},
                    {"eval_time": "25m", "alertname": "AdaptspecControllerErrors",
                     "exp_alerts": []},
                    {"eval_time": "29m", "alertname": "AdaptspecSpeculationStoppedUnderLoad",
                     "exp_alerts": []},
                    {"eval_time": "65m", "alertname": "AdaptspecSpeculationStoppedUnderLoad",
                     "exp_alerts": [{"exp_labels": {**inst, "severity": "info"},
                                     "exp_annotations": _annotations(
                                         "AdaptspecSpeculationStoppedUnderLoad", **inst)}]},
                    {"eval_time": "65m", "alertname": "AdaptspecMetricsMissing",
                     "exp_alerts": []},
                ],
            },
            {   # vLLM up, but no adaptspec_* series at all
                "interval": "1m",
                "input_series": [{"series": f"up{{{sel}}}", "values": "1x30"}],
                "alert_rule_test": [
                    {"eval_time": "20m", "alertname": "AdaptspecMetricsMissing",
                     "exp_alerts": [{"exp_labels": {**inst, "severity": "warning"},
                                     "exp_annotations": _annotations(
                                         "AdaptspecMetricsMissing", **inst)}]},
                ],
            },
        ],
    }
    path = tmp_path / "alerts-test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    proc = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
