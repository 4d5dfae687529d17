"""Whole engines side by side, taking turns, with every engine step logged.

N in-process engines (VLLM_ENABLE_V1_MULTIPROCESSING=0) in N processes: each round every
engine in turn generates the same batch of unseen chat prompts (none tuned on; 64 tokens, 4
at a time, greedy) while the others wait, so they see the same machine state round by round (a
shared machine drifts by more than the effects sought). Each round's time is compared with the
first engine's in the same round. Every engine step is logged (requests, draft tokens, whether
a prefill chunk rode along, ms from the scheduler's plan to the step's end, requests drafting,
tokens made),
and the steps at 4 requests are printed by draft tokens and by requests drafting: what a
configuration's steps cost, and how often.

    python bench/engine_ab.py ngram2 adaptspec [--rounds 4] [--prompts 16] [--slice N]
        [--json OUT] [--price REF.json ...] [--load RUN.json]

`--price`: each engine's decode tokens/s also priced by saved runs' median step time per
(requests, rows), so the engines' choices compare at one machine state (this shared machine
drifts by 10-15% between runs, more than the effects sought); `--load` reports a saved run
again instead of running the modes.

Modes: `plain` (vLLM without speculation), `ngramK` (vLLM's n-gram, static K, lookup 2-4),
`eagleK` (vLLM's eagle over `--eagle HEAD`, a head of `--model`, static K),
`adaptspec` or `adaptspec=POLICY` (adaptspec over its own n-gram proposer, K <= 8;
`adaptspec=k2`: its machinery at vLLM's static K=2, `bench unseen`'s adaptspec_k2),
`adaptspec_vllm` (adaptspec over vLLM's n-gram, K <= 8: `bench unseen`'s
adaptspec_vllm_ngram). Every engine served the same prompts the round before, so from the
second round on their prefixes are cached: these are warm engines, decode-heavier than a fresh
server. One run resolves about 3-4% (docs/unseen.md). Each engine holds its own model and KV
cache: the 0.5B takes about 6 GiB a process, so 3 engines on a 24 GiB machine.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "~/.cache/adaptspec/models/qwen/draft"


def build(mode: str, model: str, eagle: str | None = None, max_num_seqs: int = 4) -> Any:
    from vllm import LLM

    from adaptspec.tools.bench.unseen import CONFIGS, vllm_ngram_spec

    kw: dict[str, Any] = dict(model=os.path.expanduser(model), dtype="float32",
                              max_model_len=2048, max_num_seqs=max_num_seqs, enforce_eager=True,
                              seed=0, distributed_executor_backend="uni")
    if mode.startswith("ngram"):
        kw["speculative_config"] = vllm_ngram_spec(int(mode[5:]))
    elif mode.startswith("eagle"):
        if not eagle:
            raise SystemExit(f"{mode} needs --eagle HEAD")
        kw["speculative_config"] = {"method": "eagle", "model": os.path.expanduser(eagle),
                                    "num_speculative_tokens": int(mode[5:])}
    elif mode == "adaptspec_vllm" or mode.split("=")[0] == "adaptspec":
        from adaptspec.serve import SCHEDULER_CLS

        kw["scheduler_cls"] = SCHEDULER_CLS
        # (the speculative config of the `bench unseen` configuration the mode runs)
        same = "adaptspec_vllm_ngram" if mode == "adaptspec_vllm" else "adaptspec"
        kw["speculative_config"] = dict(next(c.spec for c in CONFIGS if c.name == same))
    elif mode != "plain":
        raise SystemExit(f"unknown mode {mode!r}")
    return LLM(**kw)


def engine(mode: str, order: list[str], args: argparse.Namespace, turn: Path) -> None:
    """One side: build, warm up, log the steps, generate on its turns, print the result."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = build(mode, args.model, args.eagle)
    from vllm import SamplingParams

    from adaptspec.tools.bench.prompts import load_unseen_chat

    chats = [[{"role": "user", "content": d["prompt"]}]
             for d in load_unseen_chat()["short"][: args.prompts]]
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    llm.chat(chats[:4], sp, use_tqdm=False)

    core = llm.llm_engine.engine_core.engine_core
    steps: list[tuple[int, int, bool, float, int, int, float]] = []
    planned: dict[str, Any] = {}
    schedule, step_fn = core.scheduler.schedule, core.step_fn
    drafted_ms = [0.0]  # the drafter's time in the step (vLLM's own proposers), apart
    drafter = getattr(core.model_executor.driver_worker.worker.model_runner, "drafter", None)
    if drafter is not None:
        propose = drafter.propose

        def timed_propose(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return propose(*a, **k)
            finally:
                drafted_ms[0] += (time.perf_counter() - t0) * 1e3

        drafter.propose = timed_propose

    def logged_schedule(*a: Any, **k: Any) -> Any:
        so = schedule(*a, **k)
        spec = so.scheduled_spec_decode_tokens
        planned.update(n=len(so.num_scheduled_tokens), drafts=sum(map(len, spec.values())),
                       drafting=sum(map(bool, spec.values())),
                       prefill=any(v > 1 + len(spec.get(r, ()))
                                   for r, v in so.num_scheduled_tokens.items()))
        return so

    def timed_step(*a: Any, **k: Any) -> Any:
        t0, drafted_ms[0] = time.perf_counter(), 0.0
        out = step_fn(*a, **k)
        if planned.get("n"):
            made = sum(len(o.new_token_ids) for eco in out[0].values() for o in eco.outputs)
            steps.append((planned["n"], planned["drafts"], planned["prefill"],
                          (time.perf_counter() - t0) * 1e3, planned["drafting"], made,
                          drafted_ms[0]))
        planned.clear()
        return out

    core.scheduler.schedule, core.step_fn = logged_schedule, timed_step
    (turn.parent / f"ready-{order.index(mode)}").write_text("1")
    seconds, outs = [], []
    for _ in range(args.rounds):
        while not (turn.exists() and turn.read_text() == mode):
            time.sleep(0.02)
        time.sleep(0.3)
        t0 = time.perf_counter()
        size = args.slice or len(chats)
        outs = [o for i in range(0, len(chats), size)
                for o in llm.chat(chats[i:i + size], sp, use_tqdm=False)]
        seconds.append(time.perf_counter() - t0)
        tmp = turn.with_suffix(".tmp")
        tmp.write_text(order[(order.index(mode) + 1) % len(order)])
        os.replace(tmp, turn)
    print("RESULT " + json.dumps({"seconds": seconds, "steps": steps,
                                  "tokens": [list(o.outputs[0].token_ids) for o in outs]}),
          flush=True)


def shapes(steps: list[list[Any]], batch: int = 4, by_requests: bool = False
           ) -> dict[int, tuple[int, float, float]]:
    """Decode steps (no prefill) of `batch` requests by draft tokens, or by requests drafting:
    (count, mean ms, mean tokens made; NaN in logs from before it was logged)."""
    by: dict[int, list[tuple[float, float]]] = collections.defaultdict(list)
    for n, drafts, prefill, ms, *more in steps:
        if n == batch and not prefill:
            made = float(more[1]) if len(more) > 1 else math.nan
            by[more[0] if by_requests else drafts].append((ms, made))
    return {d: (len(v), statistics.fmean(x for x, _ in v), statistics.fmean(y for _, y in v))
            for d, v in sorted(by.items())}


def by_batch(steps: list[list[Any]]) -> dict[int, tuple[int, float, int]]:
    """Decode steps (no prefill) by requests in the batch: (count, seconds, tokens made). A
    round ends draining: its last requests run in smaller batches, whose steps cost about what
    a step of 4 requests does on this CPU; apart, the full batch's tokens/s compare."""
    by: dict[int, list[Any]] = collections.defaultdict(list)
    for n, _drafts, prefill, ms, *more in steps:
        if not prefill and len(more) > 1:
            by[n].append((ms, more[1]))
    return {n: (len(v), sum(x for x, _ in v) / 1e3, sum(t for _, t in v))
            for n, v in sorted(by.items())}


def step_table(runs: list[dict[str, Any]]) -> dict[tuple[int, int], float]:
    """Median ms of the decode steps (no prefill) of saved runs (`--json` files), per
    (requests, rows): rows are requests + draft tokens, what the kernels run as one shape."""
    by: dict[tuple[int, int], list[float]] = collections.defaultdict(list)
    for run in runs:
        for res in run["engines"].values():
            for n, drafts, prefill, ms, *_ in res["steps"]:
                if not prefill:
                    by[(n, n + drafts)].append(ms)
    return {k: statistics.median(v) for k, v in by.items()}


def priced(steps: list[list[Any]], table: dict[tuple[int, int], float]) -> float | None:
    """Decode tokens/s had every decode step cost the table's median for its (requests, rows)
    (a shape the table lacks: the nearest rows it has at that many requests): the engines'
    choices compared on one machine state, which a shared machine's drift of 10-15% between
    runs hides. None without the tokens made or a table entry at some batch size."""
    rows: dict[int, list[int]] = collections.defaultdict(list)  # the table's rows by batch
    for b, r in table:
        rows[b].append(r)
    seconds = made = 0.0
    for n, drafts, prefill, _ms, *more in steps:
        if prefill:
            continue
        if len(more) < 2 or not rows.get(n):
            return None
        near = min(rows[n], key=lambda r: (abs(r - n - drafts), r))
        seconds += table[(n, near)] / 1e3
        made += more[1]
    return made / seconds if seconds else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("modes", nargs="+")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--slice", type=int, default=None,
                    help="run each round's prompts in calls of this many, each ending with its "
                         "slowest request, as `bench unseen`'s slices (default: one call)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--eagle", default=None, help="an EAGLE head of --model, for eagleK modes")
    ap.add_argument("--price", type=Path, nargs="+", default=None,
                    help="saved runs (--json files) whose decode steps price every engine's "
                         "steps, by (requests, rows): its choices on one machine state")
    ap.add_argument("--load", type=Path, default=None,
                    help="a saved run (--json) to report again instead of running the modes")
    ap.add_argument("--side", nargs=2, help=argparse.SUPPRESS)  # (one engine's process)
    args = ap.parse_args(argv)
    if len(set(args.modes)) != len(args.modes):
        ap.error("modes must differ")
    if args.side:
        engine(args.side[0], args.modes, args, Path(args.side[1]))
        return 0
    if args.load:
        out: dict[str, Any] = json.loads(args.load.read_text())["engines"]
    else:
        out = run_engines(args)
        if not out:
            return 1
    table = step_table([json.loads(p.read_text()) for p in args.price]) if args.price else {}
    report(out, args.modes, table)
    if args.json and not args.load:
        args.json.write_text(json.dumps({"modes": args.modes, "rounds": args.rounds,
                                         "prompts": args.prompts, "slice": args.slice,
                                         "engines": out}))
    return 0


def run_engines(args: argparse.Namespace) -> dict[str, Any]:
    """Each mode's engine in a process of its own, taking turns; their results by mode ({}
    when one failed)."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        turn = Path(tmp) / "turn"
        # a policy only for adaptspec's engines: with it set, the plugin would run the others
        # under adaptspec's scheduler too
        env = {k: v for k, v in os.environ.items() if k != "ADAPTSPEC_POLICY"}
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        procs = {}
        for m in args.modes:
            policy = m.split("=", 1)[1] if "=" in m else "default"
            if policy == "k2":  # the machinery at vLLM's static K=2 (`bench unseen`'s)
                from adaptspec.tools.bench.unseen import fixed_k2_policy

                policy = str(fixed_k2_policy(Path(tmp)))
            procs[m] = subprocess.Popen(
                [sys.executable, __file__, *args.modes, "--model", args.model, "--rounds",
                 str(args.rounds), "--prompts", str(args.prompts),
                 *(["--slice", str(args.slice)] if args.slice else []),
                 *(["--eagle", args.eagle] if args.eagle else []), "--side", m, str(turn)],
                env={**env, "ADAPTSPEC_POLICY": policy} if m.startswith("adaptspec") else env,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        while not all((Path(tmp) / f"ready-{i}").exists() for i in range(len(args.modes))):
            if any(p.poll() is not None for p in procs.values()):
                break
            time.sleep(1)
        turn.write_text(args.modes[0])
        for m, p in procs.items():
            text, _ = p.communicate()
            lines = [x for x in text.splitlines() if x.startswith("RESULT ")]
            if p.returncode or not lines:
                print(f"{m} engine failed (exit {p.returncode})", file=sys.stderr)
                for q in procs.values():
                    q.kill()
                return {}
            out[m] = json.loads(lines[-1][len("RESULT "):])
    return out


def report(out: dict[str, Any], modes: list[str], table: dict[tuple[int, int], float]) -> None:
    """Per engine: its rounds against the first mode's, its steps by shape, and (with a
    `table`, `step_table`) its decode tokens/s priced by it."""
    base = out[modes[0]]
    prices = {m: priced(out[m]["steps"], table) if table else None for m in modes}
    for m in modes:
        r = [b / s for b, s in zip(base["seconds"], out[m]["seconds"], strict=True)]
        out[m]["paired"] = {"median": statistics.median(r), "min": min(r), "max": max(r)}
        total = sum(s[3] for s in out[m]["steps"]) / 1e3
        pre = [s for s in out[m]["steps"] if s[2]]
        print(f"{m}: {statistics.median(out[m]['seconds']):.2f} s a round, "
              f"x{modes[0]} {statistics.median(r):.3f} (rounds {min(r):.3f}-{max(r):.3f}),"
              f" same tokens: {out[m]['tokens'] == base['tokens']}; steps {len(out[m]['steps'])}"
              f" {total:.1f} s, with a prefill {len(pre)} {sum(s[3] for s in pre) / 1e3:.1f} s")
        print("  at 4 requests, draft tokens: count x ms (tokens made)  " + "  ".join(
            f"{d}: {n} x {ms:.0f} ({t:.2f})"
            for d, (n, ms, t) in shapes(out[m]["steps"]).items()))
        print("  at 4 requests, requests drafting: count x ms (tokens made)  " + "  ".join(
            f"{d}: {n} x {ms:.0f} ({t:.2f})"
            for d, (n, ms, t) in shapes(out[m]["steps"], by_requests=True).items()))
        print("  decode steps by requests: count, s, tokens/s  " + "  ".join(
            f"{n}: {c}, {sec:.1f} s, {t / sec:.1f}" for n, (c, sec, t)
            in by_batch(out[m]["steps"]).items() if sec > 0))
        at4 = [s for s in out[m]["steps"] if s[0] == 4 and not s[2] and len(s) > 6]
        if at4 and any(s[6] for s in at4):
            print(f"  at 4 requests, the drafter's share: {statistics.fmean(s[6] for s in at4):.0f}"
                  f" ms of a {statistics.fmean(s[3] for s in at4):.0f} ms step ({len(at4)} steps)")
        if (p := prices[m]) is not None:
            ratio = f", x{modes[0]} {p / prices[modes[0]]:.3f}" if prices[modes[0]] else ""
            print(f"  priced by the reference steps: {p:.2f} decode tokens/s{ratio}")


if __name__ == "__main__":
    raise SystemExit(main())
