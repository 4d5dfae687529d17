"""The main job: a real vLLM server with adaptspec on, requests of two classes, per-class K.

Starts `adaptspec serve` on 127.0.0.1, waits for it, sends code requests (repetitive, high
n-gram acceptance) and latency-critical `interactive` requests concurrently, then reads the
server's /metrics and prints, per class: steps, mean chosen K, draft tokens and acceptance.
Stops the server with SIGTERM. Standard library only on this side (urllib).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

CODE_PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "import os\nimport sys\nimport json\n\ndef read_json(path):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(",
]
CHAT_PROMPTS = [
    "Tell me a short story about a lighthouse keeper.",
    "What is a good name for a cat?",
    "Describe the colour blue to someone who has never seen it.",
]


def http_json(url: str, body: dict | None = None, timeout: float = 600.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def http_text(url: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def wait_ready(base: str, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
        try:
            urllib.request.urlopen(base + "/health", timeout=2).read()
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1.0)
    raise TimeoutError(f"server not ready after {timeout_s:.0f} s")


def parse_metrics(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Prometheus text format -> {sample name: {sorted label pairs: value}}."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name][tuple(sorted(sample.labels.items()))] = sample.value
    return out


def per_class(metrics: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Per-class summary of the adaptspec_* series."""
    rows: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for labels, v in metrics.get("adaptspec_draft_tokens_total", {}).items():
        rows[dict(labels)["class"]]["draft_tokens"] += v
    for labels, v in metrics.get("adaptspec_accepted_tokens_total", {}).items():
        rows[dict(labels)["class"]]["accepted_tokens"] += v
    for labels, v in metrics.get("adaptspec_chosen_k_sum", {}).items():
        rows[dict(labels)["class"]]["k_sum"] += v
    for labels, v in metrics.get("adaptspec_chosen_k_count", {}).items():
        rows[dict(labels)["class"]]["k_count"] += v
    for labels, v in metrics.get("adaptspec_steps_total", {}).items():
        d = dict(labels)
        rows[d["class"]]["steps_" + d["decision"]] += v
    for r in rows.values():
        r["mean_k"] = r["k_sum"] / r["k_count"] if r["k_count"] else 0.0
        r["acceptance"] = r["accepted_tokens"] / r["draft_tokens"] if r["draft_tokens"] else 0.0
    return {k: dict(v) for k, v in rows.items()}


def _complete(base: str, model: str, prompt: str, cls: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    out = http_json(base + "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "vllm_xargs": {"adaptspec_class": cls},
    })
    elapsed = time.perf_counter() - t0
    return {"class": cls, "tokens": out["usage"]["completion_tokens"], "seconds": elapsed}


def run_demo(args: argparse.Namespace) -> int:
    model = args.model
    if model is None:
        from adaptspec.tools.models import build_qwen

        print("adaptspec demo: fetching the Qwen2.5-Coder pair (cached after the first run)")
        model = build_qwen()["draft"]  # the 0.5B: our model-free proposers need no draft model
    base = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "adaptspec.cli", "serve", str(model), "--policy", args.policy,
           "--port", str(args.port), "--max-model-len", "2048", "--max-num-seqs", "16",
           "--enforce-eager", "--served-model-name", "default"]
    print("adaptspec demo: starting", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd)
    try:
        wait_ready(base, proc)
        code = [(p, "code") for p in (CODE_PROMPTS * args.requests)[: args.requests]]
        mixed = code + [(p, "interactive") for p in (CHAT_PROMPTS * args.requests)
                        [: args.requests]]
        done: list[dict] = []
        t0 = time.perf_counter()
        # Code alone first, then code beside a latency-critical stream: the second phase shows
        # the controller holding back so the interactive requests' steps stay fast.
        for phase, jobs in (("code alone", code), ("code + interactive", mixed)):
            print(f"adaptspec demo: {phase}: {len(jobs)} requests, concurrently", flush=True)
            with ThreadPoolExecutor(max_workers=8) as pool:
                done += pool.map(lambda j: _complete(base, "default", j[0], j[1],
                                                     args.max_tokens), jobs)
        wall = time.perf_counter() - t0
        summary = per_class(parse_metrics(http_text(base + "/metrics")))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    tokens = sum(d["tokens"] for d in done)
    print(f"\n{tokens} tokens in {wall:.1f} s ({tokens / wall:.2f} tok/s over all requests)")
    print(f"{'class':<14}{'requests':>9}{'mean K':>8}{'drafted':>9}{'accepted':>9}"
          f"{'accept':>8}{'plain steps':>12}")
    for cls in sorted({d["class"] for d in done}):
        r = summary.get(cls, {})
        n = sum(1 for d in done if d["class"] == cls)
        plain = r.get("steps_plain", 0) + r.get("steps_latency_critical", 0)
        print(f"{cls:<14}{n:>9}{r.get('mean_k', 0):>8.2f}{r.get('draft_tokens', 0):>9.0f}"
              f"{r.get('accepted_tokens', 0):>9.0f}{r.get('acceptance', 0):>8.2f}{plain:>12.0f}")
    Path("out").mkdir(exist_ok=True)
    Path("out/demo.json").write_text(json.dumps({"classes": summary, "requests": done}, indent=2))
    print("wrote out/demo.json")
    return 0
