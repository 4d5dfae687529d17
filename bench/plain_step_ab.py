"""Does adaptspec cost anything when it drafts nothing? Plain vLLM against adaptspec held at K=0.

Two in-process engines (VLLM_ENABLE_V1_MULTIPROCESSING=0) in two processes at once, taking
turns: each round one engine generates the same batch while the other waits, so the two see the
same machine state, round by round (a shared machine drifts by more than the effect sought).
adaptspec runs over its own n-gram proposer (K <= 8) with a policy whose only class is
latency-critical, so it drafts nothing, and every step still goes through its scheduler,
controller, proposer hook and account.

    python bench/plain_step_ab.py [--model DIR] [--rounds 10] [--json OUT]

Default model: the Qwen pair's 1.5B target, float32, 5 requests of 500 random token ids, 24
tokens each: the trace's plain steps. Prints each engine's median seconds a round and the
ratio; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

POLICY = """version: 1
default_class: interactive
k_max: 8
classes:
  interactive: {latency_critical: true}
"""


def engine(mode: str, other: str, rounds: int, model: str, turn: Path, first: str) -> None:
    """One side: build the engine, warm up, then generate on its turns."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from adaptspec.serve import PROPOSERS, SCHEDULER_CLS

    kw: dict = dict(model=model, dtype="float32", max_model_len=2048, max_num_seqs=8,
                    enforce_eager=True, seed=0, distributed_executor_backend="uni")
    if mode == "adaptspec":
        kw["speculative_config"] = {"method": "custom_class", "model": PROPOSERS["ngram"],
                                    "num_speculative_tokens": 8}
        kw["scheduler_cls"] = SCHEDULER_CLS
    llm = LLM(**kw)
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(100, 20000) for _ in range(500)])
               for _ in range(5)]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)
    if mode == first:
        turn.write_text(mode)
    seconds = []
    for _ in range(rounds):
        while not (turn.exists() and turn.read_text() == mode):
            time.sleep(0.05)
        time.sleep(0.5)
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
        tmp = turn.with_suffix(".tmp")
        tmp.write_text(other)
        os.replace(tmp, turn)
    print("RESULT " + json.dumps(seconds), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(Path.home() / ".cache/adaptspec/models/qwen/target"))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--side", nargs=5, help=argparse.SUPPRESS)  # (one engine's process)
    args = ap.parse_args(argv)
    if args.side:
        mode, other, rounds, turn, first = args.side
        engine(mode, other, int(rounds), args.model, Path(turn), first)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        policy, turn = Path(tmp) / "policy.yaml", Path(tmp) / "turn"
        policy.write_text(POLICY)
        # two engines' KV caches on one machine; the policy for adaptspec's engine only (with
        # it set, the plugin would run plain vLLM under adaptspec's scheduler too)
        env = {k: v for k, v in os.environ.items() if k != "ADAPTSPEC_POLICY"}
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        procs = {mode: subprocess.Popen(
            [sys.executable, __file__, "--model", args.model, "--side", mode, other,
             str(args.rounds), str(turn), "plain"],
            env={**env, "ADAPTSPEC_POLICY": str(policy)} if mode == "adaptspec" else env,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            for mode, other in (("plain", "adaptspec"), ("adaptspec", "plain"))}
        out = {}
        for mode, proc in procs.items():
            text, _ = proc.communicate()
            lines = [x for x in text.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(f"{mode} engine failed (exit {proc.returncode})", file=sys.stderr)
                return 1
            out[mode] = json.loads(lines[-1][len("RESULT "):])
    med = {m: statistics.median(v) for m, v in out.items()}
    ratios = [a / p for a, p in zip(out["adaptspec"], out["plain"], strict=True)]
    result = {"model": args.model, "rounds": args.rounds, "seconds": out, "median_s": med,
              "adaptspec_over_plain_median": med["adaptspec"] / med["plain"],
              "paired_ratio_median": statistics.median(ratios),
              "paired_ratio_range": [min(ratios), max(ratios)]}
    print(f"plain {med['plain']:.2f} s a round, adaptspec at K=0 {med['adaptspec']:.2f} s: "
          f"{result['adaptspec_over_plain_median']:.3f}x; round by round "
          f"{result['paired_ratio_median']:.3f}x (range {min(ratios):.3f}-{max(ratios):.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
