"""The trace's code phases without its latency-critical stream: what adaptspec and a static K draft.

One in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, the 1.5B target, float32, eager, at
most 4 requests) runs `bench trace`'s code prompts as raw completions, 32 greedy tokens with
`ignore_eos`: the first phase's 3 one at a time (`1`), or the second phase's 8, 4 at a time
(`4`). Every step is logged (the plan's K and its reason, drafts proposed and kept, verified
and accepted) and the totals printed: with no latency-critical request in the batch, does
adaptspec draft what the static K does?

    python bench/code_phase.py adaptspec|ngram4|plain [1|4] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
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
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if args.mode.startswith("adaptspec"):
        os.environ["ADAPTSPEC_POLICY"] = "bench"
    from vllm import SamplingParams

    from adaptspec.tools.bench.prompts import load_trace

    llm = engine_ab.build(args.mode, TARGET)
    code = [d["prompt"] for d in load_trace()["code"]]
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

    def logged_output(so: Any, out: Any) -> Any:
        va = []
        for rid, d in so.scheduled_spec_decode_tokens.items():
            i = out.req_id_to_index.get(rid)
            if i is not None:
                va.append([len(d), len(out.sampled_token_ids[i]) - 1])
        log.append({"verified_accepted": va, **cur})
        cur.clear()
        return update_output(so, out)

    sched.update_draft_token_ids, sched.update_from_output = logged_drafts, logged_output
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    if args.users == 1:
        for p in code[:3]:
            llm.generate([p], sp, use_tqdm=False)
    else:
        llm.generate(code[3:11], sp, use_tqdm=False)
    seconds = time.perf_counter() - t0
    verified = sum(v for s in log for v, _ in s["verified_accepted"])
    accepted = sum(a for s in log for _, a in s["verified_accepted"])
    result = {"mode": args.mode, "users": args.users, "seconds": round(seconds, 2),
              "steps": len(log), "verified": verified, "accepted": accepted}
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps({**result, "log": log}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
