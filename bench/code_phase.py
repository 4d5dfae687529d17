"""The trace's code phases in-process: what adaptspec and a static K draft, with or without a
latency-critical request beside them.

One in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, the 1.5B target, float32, eager, at
most 4 requests; 5 with `--lc`) runs `bench trace`'s code prompts as raw completions, 32 greedy
tokens with `ignore_eos`: the first phase's 3 one at a time (`1`), or the second phase's 8, 4 at
a time (`4`). With `--lc`, each batch also carries one of the trace's latency-critical prompts
(class `interactive`, as long as the batch), so that every decode step has one. Every step is
logged (the plan's K and its reason, drafts proposed and kept, verified and accepted, its time
and whether it decoded the latency-critical request beside a code one) and the totals printed:
the code requests' time (the steps that ran one), and the mean time of the steps the
latency-critical request shared with them (its gap between tokens there).

    python bench/code_phase.py adaptspec|ngram4|plain [1|4] [--lc] [--burst B] [--kind K]
        [--json OUT]

`--kind K`: another kind of the trace's prompts instead of code (writing, math, roleplay), sent
as its class.

`--burst B`: adaptspec with the bench policy's `latency_critical_burst` set to B (0.25 as
shipped: its 5% slack spent over the latency-critical request's steps, docs/design.md; 0.05,
the slack: every step capped at it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import engine_ab  # noqa: E402  (the engines the A/B builds)

TARGET = "~/.cache/adaptspec/models/qwen/target"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode")
    ap.add_argument("users", nargs="?", type=int, default=1, choices=(1, 4))
    ap.add_argument("--lc", action="store_true")
    ap.add_argument("--burst", type=float, default=None)
    ap.add_argument("--kind", default="code", help="the trace's prompts of this kind "
                    "(code, writing, math, roleplay), sent as its class")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if args.mode.startswith("adaptspec"):
        os.environ["ADAPTSPEC_POLICY"] = "bench"
        if args.burst is not None:
            from adaptspec.policy import load_policy

            policy = load_policy("bench").model_copy(update={"latency_critical_burst": args.burst})
            path = Path(tempfile.mkdtemp()) / "bench_burst.json"
            path.write_text(policy.model_dump_json())
            os.environ["ADAPTSPEC_POLICY"] = str(path)
    from vllm import SamplingParams

    from adaptspec.tools.bench.prompts import load_trace

    llm = engine_ab.build(args.mode, TARGET, max_num_seqs=5 if args.lc else 4)
    trace = load_trace()
    kind_prompts = [d["prompt"] for d in trace[args.kind]]
    quick = trace["interactive"]
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    log: list[dict[str, Any]] = []
    cur: dict[str, Any] = {}
    update_drafts, update_output = sched.update_draft_token_ids, sched.update_from_output

    def logged_drafts(dt: Any) -> None:
        rt = getattr(sched, "runtime", None)
        plan = rt.plan_for(dt.req_ids) if rt is not None else None
        cur.update(proposed=[len(x) for x in dt.draft_token_ids],
                   k=[[plan.k_of(r), plan.reason_of(r)] for r in dt.req_ids] if plan else None)
        update_drafts(dt)
        cur["kept"] = [len(sched.requests[r].spec_token_ids) for r in dt.req_ids
                       if r in sched.requests]

    last = [time.perf_counter()]

    def logged_output(so: Any, out: Any) -> Any:
        now = time.perf_counter()
        va = []
        for rid, d in so.scheduled_spec_decode_tokens.items():
            i = out.req_id_to_index.get(rid)
            if i is not None:
                va.append([len(d), len(out.sampled_token_ids[i]) - 1])
        classes = {r: _class(sched, r) for r in so.num_scheduled_tokens}
        kind_step = args.kind in classes.values()
        # a decode step of the latency-critical request (one token: not its prefill) beside
        # a request of the kind run
        lc = kind_step and any(n == 1 and classes[r] == "interactive"
                               for r, n in so.num_scheduled_tokens.items())
        log.append({"verified_accepted": va, "ms": round((now - last[0]) * 1e3, 2), "lc": lc,
                    "code": kind_step, **cur})
        cur.clear()
        last[0] = now
        return update_output(so, out)

    sched.update_draft_token_ids, sched.update_from_output = logged_drafts, logged_output

    def params(cls: str, tokens: int = 32) -> Any:
        return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                              extra_args={"adaptspec_class": cls})

    batches = ([kind_prompts[i:i + 1] for i in range(3)] if args.users == 1
               else [kind_prompts[3:11]])
    t0 = time.perf_counter()
    for j, batch in enumerate(batches):
        prompts, sps = batch, [params(args.kind)] * len(batch)
        if args.lc:  # as many tokens as the batch's requests decode, one after another
            tokens = 32 * -(-len(batch) // 4)
            prompts, sps = [*batch, quick[j % len(quick)]], [*sps, params("interactive", tokens)]
        last[0] = time.perf_counter()
        llm.generate(prompts, sps, use_tqdm=False)
    seconds = time.perf_counter() - t0
    verified = sum(v for s in log for v, _ in s["verified_accepted"])
    accepted = sum(a for s in log for _, a in s["verified_accepted"])
    lc_ms = [s["ms"] for s in log if s["lc"]]
    # the code requests' time: the steps that ran one (the latency-critical request may run on)
    code_s = sum(s["ms"] for s in log if s["code"]) / 1e3
    result = {"mode": args.mode, "kind": args.kind, "users": args.users, "lc": args.lc,
              "burst": args.burst,
              "seconds": round(seconds, 2), "code_seconds": round(code_s, 2),
              "steps": len(log), "verified": verified,
              "accepted": accepted,
              "lc_steps": len(lc_ms), "lc_step_ms_mean": round(sum(lc_ms) / len(lc_ms), 1)
              if lc_ms else None,
              "lc_steps_drafted": sum(1 for s in log if s["lc"] and s["verified_accepted"])}
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps({**result, "log": log}, indent=1))
    return 0


def _class(sched: Any, req_id: str) -> str | None:
    req = sched.requests.get(req_id)
    extra = getattr(getattr(req, "sampling_params", None), "extra_args", None) or {}
    return extra.get("adaptspec_class")


if __name__ == "__main__":
    sys.exit(main())
