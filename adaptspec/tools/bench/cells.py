"""One cell: a request stream at one concurrency against one server, and the metrics it moved."""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from adaptspec.tools.bench import workload
from adaptspec.tools.bench.client import StreamResult, stream_completion
from adaptspec.tools.bench.servers import Server

# ------------------------------------------------------------------------------ load


def request_body(req: workload.Request, prompt: str) -> dict[str, Any]:
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
            self.samples.append({"t": time.monotonic() - self._t0, **class_counters(m)})

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join()
        return self.samples


def class_counters(m: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Cumulative per-class adaptspec counters: drafted, accepted, chosen K sum and count, the
    speculating decisions per proposer chosen (`speculate_<proposer>`), the drafts each
    proposer had verified and accepted (`drafted_<proposer>`, `accepted_<proposer>`), per draft
    position j (`drafted_pos<j>`, `accepted_pos<j>`), and the
    draft tokens the cut dropped (`confidence_cut`, `trimmed`; `confidence_drafts`: drafts
    that reached it with a confidence)."""
    out: dict[str, dict[str, float]] = {}

    def add(metric: str, key: str) -> None:
        for labels, v in m.get(metric, {}).items():
            cls = dict(labels).get("class")
            if cls is not None:
                out.setdefault(cls, {})[key] = out.get(cls, {}).get(key, 0.0) + v

    add("adaptspec_draft_tokens_total", "drafted")
    add("adaptspec_accepted_tokens_total", "accepted")
    # ... and per proposer (what the simulator's hybrid is fitted to) and per draft position
    # (0-based; the class's drafts of every proposer)
    for metric, key, label in (
            ("adaptspec_draft_tokens_total", "drafted_", "proposer"),
            ("adaptspec_accepted_tokens_total", "accepted_", "proposer"),
            ("adaptspec_draft_tokens_per_pos_total", "drafted_pos", "position"),
            ("adaptspec_accepted_tokens_per_pos_total", "accepted_pos", "position")):
        for labels, v in m.get(metric, {}).items():
            d = dict(labels)
            if "class" in d and label in d:
                row = out.setdefault(d["class"], {})
                row[key + d[label]] = row.get(key + d[label], 0.0) + v
    add("adaptspec_chosen_k_sum", "k_sum")
    add("adaptspec_chosen_k_count", "k_count")
    # where proposed drafts went before verification: cut for low confidence, or trimmed
    # (either cause) to the step shape that pays
    add("adaptspec_confidence_drafts_total", "confidence_drafts")
    add("adaptspec_confidence_cut_tokens_total", "confidence_cut")
    add("adaptspec_trimmed_tokens_total", "trimmed")
    for labels, v in m.get("adaptspec_steps_total", {}).items():
        d = dict(labels)
        if d.get("decision") == "speculate" and "class" in d:
            key = f"speculate_{d.get('proposer', '?')}"
            row = out.setdefault(d["class"], {})
            row[key] = row.get(key, 0.0) + v
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
            "vllm:spec_decode_num_accepted_tokens_total",
            # adaptspec's in-engine account of its speculating steps against plain decoding
            "adaptspec_payoff_lost_ms_total", "adaptspec_payoff_saved_ms_total")
    out = {k: sum(m.get(k, {}).values()) for k in keys}
    # vLLM's accepted draft tokens per position (0-based): "accepted_pos:<j>"
    for labels, v in m.get("vllm:spec_decode_num_accepted_tokens_per_pos_total", {}).items():
        key = f"accepted_pos:{dict(labels).get('position', '?')}"
        out[key] = out.get(key, 0.0) + v
    # the hybrid's draft model: the controller's fit of its cost (ms per draft token, per
    # catch-up token), for the simulator's hybrid
    for labels, v in m.get("adaptspec_draft_model_cost_ms", {}).items():
        out[f"draft_model_ms_{dict(labels).get('kind', '?')}"] = v
    # the engine's time account, seconds by category (adaptspec/account.py)
    for series, prefix in (("adaptspec_engine_seconds_total", "engine_s_"),
                           ("adaptspec_engine_steps_total", "engine_steps_")):
        for labels, v in m.get(series, {}).items():
            key = prefix + dict(labels).get("category", "?")
            out[key] = out.get(key, 0.0) + v
    # ... its decode steps by batch size: "engine_decode:<seconds|steps|drafts>:<category>:<batch>"
    for what in ("seconds", "steps", "drafts"):
        for labels, v in m.get(f"adaptspec_engine_decode_{what}_total", {}).items():
            d = dict(labels)
            key = f"engine_decode:{what}:{d.get('category', '?')}:{d.get('batch', '?')}"
            out[key] = out.get(key, 0.0) + v
    return out


def decode_by_batch(after: dict[str, float], before: dict[str, float]
                    ) -> dict[str, dict[str, dict[str, float]]]:
    """What a cell's decode steps took, from two `_spec_counters` readings: per category
    (decode_plain, decode_spec) and batch size, the steps, ms per step and drafts per step."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for key, v in after.items():
        if not key.startswith("engine_decode:"):
            continue
        _, what, cat, batch = key.split(":")
        out.setdefault(cat, {}).setdefault(batch, {})[what] = v - before.get(key, 0.0)
    return {cat: {b: {"steps": d.get("steps", 0.0),
                      "ms_per_step": 1e3 * d.get("seconds", 0.0) / d["steps"],
                      "drafts_per_step": d.get("drafts", 0.0) / d["steps"]}
                  for b, d in sorted(rows.items(), key=lambda x: int(x[0]))
                  if d.get("steps")}
            for cat, rows in sorted(out.items())}


def run_cell(server: Server, stream: list[workload.Request], prompts: dict[str, str],
             concurrency: int, label: str, tick: Callable[[], Any] | None = None
             ) -> dict[str, Any]:
    """The stream at one concurrency; per-request results and the metrics it moved. `tick` is
    called as each request ends (default: a progress line on stderr)."""
    before = server.metrics()
    tick = tick or Progress(label, len(stream)).tick

    def one(req: workload.Request) -> tuple[workload.Request, float, StreamResult]:
        start = time.perf_counter() - t0
        res = stream_completion(server.port, request_body(req, prompts[req.id]), timeout=1800)
        tick()
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
        "class_before": class_counters(before), "class_after": class_counters(after),
    }


def gaps_ms(requests: list[dict[str, Any]]) -> list[float]:
    """Inter-token gaps (ms) of run_cell's requests, each token of a chunk getting the chunk's
    gap over its tokens (as the benchmark's per-class ITL)."""
    return [(t[i] - t[i - 1]) * 1e3 / k[i] for r in requests
            for t, k in [(r["chunk_times"], r["chunk_tokens"])] for i in range(1, len(t))
            for _ in range(k[i])]


def median_gap_ms(requests: list[dict[str, Any]]) -> float:
    """Median of `gaps_ms`."""
    gaps = gaps_ms(requests)
    return statistics.median(gaps) if gaps else float("nan")
