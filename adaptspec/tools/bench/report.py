"""What a run measured: per-cell summaries, ratios to plain decoding, tables and plots."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

from adaptspec.tools.bench import steps, workload
from adaptspec.tools.bench.cells import decode_by_batch
from adaptspec.tools.bench.servers import Config

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
            # Which proposer the controller chose for the class's speculating request-steps.
            chose = {key.removeprefix("speculate_"): a[key] - b.get(key, 0.0)
                     for key in a if key.startswith("speculate_")}
            total = sum(chose.values())
            if total:
                row["proposer_share"] = {k: v / total for k, v in sorted(chose.items()) if v}
            # Per proposer: its speculating decisions, the drafts it had verified, accepted.
            per_prop = {
                p: {"decisions": n_p,
                    "drafted": a.get(f"drafted_{p}", 0.0) - b.get(f"drafted_{p}", 0.0),
                    "accepted": a.get(f"accepted_{p}", 0.0) - b.get(f"accepted_{p}", 0.0)}
                for p, n_p in sorted(chose.items())}
            if len(per_prop) > 1 or any(v["drafted"] for v in per_prop.values()):
                row["proposers"] = per_prop
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
        # The engine's time account over the cell (servers run by adaptspec's scheduler only):
        # seconds per category, adaptspec/account.py.
        **({"engine_s": engine_s} if (engine_s := _account_delta(sb, sa)) else {}),
        **({"engine_decode": dec} if (dec := decode_by_batch(sa, sb)) else {}),
        "classes": classes,
        # the hybrid's draft model, as the controller fitted it by the cell's end
        **({"draft_model_cost_ms": {k.removeprefix("draft_model_ms_"): v
                                    for k, v in sa.items() if k.startswith("draft_model_ms_")}}
           if any(k.startswith("draft_model_ms_") for k in sa) else {}),
    }


def _account_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k.removeprefix("engine_s_"): after[k] - before.get(k, 0.0)
            for k in after if k.startswith("engine_s_")}


def account_table(summary: dict[str, dict[int, dict]]) -> str:
    """Per server that kept the engine's time account and concurrency: its serving time (all
    but idle) over the cell's wall time, and each category's share of that time ("" when no
    server kept one)."""
    from adaptspec.account import CATEGORIES

    shown = [c for c in CATEGORIES if c != "idle"]
    rows = []
    for name, by_c in summary.items():
        for c in sorted(by_c, key=int):
            acct = by_c[c].get("engine_s")
            if not acct:
                continue
            serving = sum(v for k, v in acct.items() if k != "idle")
            share = "".join(f"{acct.get(k, 0.0) / serving if serving else 0.0:>13.1%}"
                            for k in shown)
            rows.append(f"{name:<18}{c:>4}{serving / by_c[c]['wall_s']:>14.3f}{share}")
    if not rows:
        return ""
    head = (f"engine time account (adaptspec/account.py): serving time over wall time, and "
            f"each category's share of it\n{'config':<18}{'c':>4}{'account/wall':>14}"
            + "".join(f"{k:>13}" for k in shown))
    return "\n".join([head, *rows])


def decode_table(rows: dict[str, dict[str, dict[str, dict[str, float]]]]) -> str:
    """Per server (label -> `cells.decode_by_batch`): at each batch size, ms per plain decode
    step and per speculating one, with their counts and the drafts a speculating step verified
    ("" when no server kept an account)."""
    lines = []
    w = max((len(label) for label in rows), default=0) + 2
    for label, dec in rows.items():
        plain, spec = dec.get("decode_plain", {}), dec.get("decode_spec", {})
        for b in sorted(set(plain) | set(spec), key=int):
            p, q = plain.get(b), spec.get(b)
            lines.append(
                f"{label:<{w}}{b:>6}"
                + (f"{p['ms_per_step']:>10.1f}{p['steps']:>7.0f}" if p else f"{'-':>10}{'':>7}")
                + (f"{q['ms_per_step']:>10.1f}{q['steps']:>7.0f}{q['drafts_per_step']:>9.2f}"
                   if q else f"{'-':>10}{'':>7}{'':>9}"))
    if not lines:
        return ""
    head = (f"decode steps by batch size (engine account): ms per step and steps, plain and "
            f"speculating (drafts verified per step)\n{'server':<{w}}{'batch':>6}{'plain ms':>10}"
            f"{'n':>7}{'spec ms':>10}{'n':>7}{'drafts':>9}")
    return "\n".join([head, *lines])


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


def proposer_table(summary: dict[str, dict[int, dict]]) -> str:
    """Per configuration with several proposers: the share of each class's speculating
    request-steps each proposer drafted, per concurrency ("" when none)."""
    lines = []
    for name, by_c in summary.items():
        shares = {(c, cls): row["proposer_share"] for c, cell in by_c.items()
                  for cls, row in cell["classes"].items() if "proposer_share" in row}
        if not any(len(v) > 1 for v in shares.values()):
            continue
        concs = sorted(by_c)
        lines.append(f"{name}: proposer chosen per class (share of its speculating "
                     f"request-steps)")
        lines.append(f"{'class':<14}" + "".join(f"{'c=' + str(c):>28}" for c in concs))
        for cls in sorted({cls for _, cls in shares}):
            cells = "".join(
                f"{' '.join(f'{p} {v:.0%}' for p, v in shares.get((c, cls), {}).items()):>28}"
                for c in concs)
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
