"""What does a step that carries a prefill chunk cost, alone and beside decoding requests?

Under plain decoding with requests of one length, the requests of a closed-loop batch finish
together and the next ones are prefilled together, in steps that carry no decode; under
speculation they finish unevenly, and each prompt is prefilled beside requests that decode (and
verify drafts). The engine account (adaptspec/account.py) shows speculating servers spending
more in steps that carry a prefill (docs/unseen.md). This measures whether such a mixed
step costs more than its prefill and its decodes would apart, in one in-process eager engine
(the default 0.5B in float32, the sizes `bench unseen`'s servers run with):

- wave: `--batch` long prompts arrive at once, prefilled in steps that carry no decode, then
  decoded together to the end;
- staggered: the same prompts arrive one at a time, each after the previous one decoded
  `--gap` tokens, so each prefill shares its step with the requests decoding.

Both scenarios serve the same prompts, so prefix caching is off (a second pass over a prompt
would find it cached). Every step's time, token counts and drafts are kept; it prints the
steps that carry a prefill chunk per scenario and each scenario's total time. `--mode plain`
or `ngramK` (vLLM's n-gram proposer at K, lookup 2-4).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 \
        python bench/prefill_mix.py --mode plain [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "~/.cache/adaptspec/models/qwen/draft"


def build(mode: str, model: str) -> Any:
    from vllm import LLM

    kw: dict[str, Any] = dict(model=os.path.expanduser(model), dtype="float32",
                              max_model_len=1024, max_num_seqs=6, max_num_batched_tokens=6144,
                              enforce_eager=True, seed=0, distributed_executor_backend="uni",
                              enable_prefix_caching=False)
    if mode.startswith("ngram"):
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": int(mode[5:]),
                                    "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    elif mode != "plain":
        raise SystemExit(f"unknown mode {mode!r}")
    return LLM(**kw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="plain")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--gap", type=int, default=12, help="tokens decoded between arrivals")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = build(args.mode, args.model)
    from vllm import SamplingParams

    from adaptspec.account import carries_prefill
    from adaptspec.tools.bench.prompts import load_unseen_chat

    tok = llm.get_tokenizer()
    longs = [d["prompt"] for d in load_unseen_chat()["long"]]
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                       add_generation_prompt=True) for p in longs]
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up

    eng = llm.llm_engine
    core = eng.engine_core.engine_core
    schedule, step_fn = core.scheduler.schedule, core.step_fn
    steps: list[dict[str, Any]] = []
    planned: dict[str, Any] = {}

    def logged_schedule(*a: Any, **k: Any) -> Any:
        so = schedule(*a, **k)
        spec = so.scheduled_spec_decode_tokens
        pre = dec = 0
        for r, n in so.num_scheduled_tokens.items():
            if carries_prefill(n, spec.get(r, ())):
                pre += n
            else:
                dec += n
        planned.update(n=len(so.num_scheduled_tokens), prefill_tokens=pre, decode_tokens=dec,
                       drafts=sum(map(len, spec.values())))
        return so

    def timed_step(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        out = step_fn(*a, **k)
        if planned.get("n"):
            steps.append({**planned, "ms": (time.perf_counter() - t0) * 1e3})
        planned.clear()
        return out

    core.scheduler.schedule, core.step_fn = logged_schedule, timed_step
    result: dict[str, Any] = {"mode": args.mode, "batch": args.batch, "gap": args.gap,
                              "tokens": args.tokens, "rounds": []}
    serial = 0
    for rnd in range(args.rounds):
        for scenario in ("wave", "staggered"):
            steps.clear()
            chosen = prompts[(rnd * args.batch) % len(prompts):][: args.batch]
            t0 = time.perf_counter()
            pending = list(chosen)
            made = 0  # decode steps since the last arrival
            if scenario == "wave":
                for p in pending:
                    eng.add_request(f"r{serial}", p, sp)
                    serial += 1
                pending = []
            while pending or eng.has_unfinished_requests():
                if pending and (made >= args.gap or not eng.has_unfinished_requests()):
                    eng.add_request(f"r{serial}", pending.pop(0), sp)
                    serial += 1
                    made = 0
                eng.step()
                made += 1
            wall = time.perf_counter() - t0
            mixed = [s for s in steps if s["prefill_tokens"] and s["decode_tokens"]]
            alone = [s for s in steps if s["prefill_tokens"] and not s["decode_tokens"]]
            decode = [s for s in steps if not s["prefill_tokens"]]
            row = {"scenario": scenario, "round": rnd, "wall_s": wall, "steps": list(steps)}
            result["rounds"].append(row)
            print(f"round {rnd} {scenario:<9} wall {wall:6.2f} s  steps {len(steps):>3}  "
                  f"prefill-only {len(alone)} ({sum(s['ms'] for s in alone) / 1e3:.2f} s, "
                  f"{sum(s['prefill_tokens'] for s in alone)} tokens)  mixed {len(mixed)} "
                  f"({sum(s['ms'] for s in mixed) / 1e3:.2f} s, "
                  f"{sum(s['prefill_tokens'] for s in mixed)} + "
                  f"{sum(s['decode_tokens'] for s in mixed)} tokens, "
                  f"{sum(s['drafts'] for s in mixed)} drafts)  decode {len(decode)} "
                  f"({sum(s['ms'] for s in decode) / 1e3:.2f} s)", flush=True)
            for s in alone + mixed:
                print(f"    n={s['n']} prefill {s['prefill_tokens']:>5} decode "
                      f"{s['decode_tokens']:>3} drafts {s['drafts']:>2}  {s['ms']:8.1f} ms  "
                      f"{s['ms'] / max(s['prefill_tokens'], 1):.2f} ms/prefill token")
    walls = {sc: statistics.median(r["wall_s"] for r in result["rounds"]
                                   if r["scenario"] == sc) for sc in ("wave", "staggered")}
    print(f"median wall: wave {walls['wave']:.2f} s, staggered {walls['staggered']:.2f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
