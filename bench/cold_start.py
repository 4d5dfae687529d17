"""A fresh engine's first minutes: what adaptspec drafts, cuts and gets accepted, slice by slice.

One in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) runs the short unseen chat prompts in
slices of 8 (64 tokens, 4 at a time, greedy) after `bench unseen`'s warm-up (two of them, 8
tokens), and counts per slice: engine steps, draft tokens proposed, kept after the plan's K,
kept after the confidence cut, verified and accepted, and how many of the cut's decisions used
a calibrated confidence bin and how many only ranked drafts by an uncalibrated one
(Controller.cut).

    python bench/cold_start.py [default|k2] [--slices 4] [--json OUT]

`k2` is `bench unseen`'s adaptspec_k2: the same machinery drafting K=2 whatever it learned.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import engine_ab  # noqa: E402  (the engines the A/B builds: same model, sizes and proposer)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("policy", nargs="?", default="default", choices=("default", "k2"))
    ap.add_argument("--slices", type=int, default=4)
    ap.add_argument("--model", default=engine_ab.DEFAULT_MODEL)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    policy = "default"
    if args.policy == "k2":
        from adaptspec.tools.bench.unseen import fixed_k2_policy

        policy = str(fixed_k2_policy(Path(tempfile.mkdtemp())))
    os.environ["ADAPTSPEC_POLICY"] = policy
    import numpy as np
    from vllm import SamplingParams

    from adaptspec.tools.bench.prompts import load_unseen_chat

    llm = engine_ab.build("adaptspec", args.model)
    chats = [[{"role": "user", "content": d["prompt"]}] for d in load_unseen_chat()["short"]]
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    count: collections.Counter[str] = collections.Counter()
    update_drafts, update_output = sched.update_draft_token_ids, sched.update_from_output
    calibration = sched.runtime.controller.confidence
    shift = calibration.shift

    def counted_drafts(dt: Any) -> None:
        plan = sched.runtime.plan_for(dt.req_ids)
        count["proposed"] += sum(len(x) for x in dt.draft_token_ids)
        count["after_k"] += sum(min(len(x), plan.k_of(r))
                                for r, x in zip(dt.req_ids, dt.draft_token_ids, strict=True))
        update_drafts(dt)
        count["after_cut"] += sum(len(sched.requests[r].spec_token_ids) for r in dt.req_ids
                                  if r in sched.requests)

    def counted_output(so: Any, out: Any) -> Any:
        count["steps"] += 1
        for rid, d in so.scheduled_spec_decode_tokens.items():
            i = out.req_id_to_index.get(rid)
            if d and i is not None:
                count["verified"] += len(d)
                count["accepted"] += len(out.sampled_token_ids[i]) - 1
        return update_output(so, out)

    def counted_shift(rows: Any, conf: Any) -> Any:
        s = shift(rows, conf)
        count["cut_calibrated"] += int(np.isfinite(s).sum())
        count["cut_uncalibrated"] += int((~np.isfinite(s)).sum())
        return s

    sched.update_draft_token_ids, sched.update_from_output = counted_drafts, counted_output
    calibration.shift = counted_shift
    llm.chat(chats[:2], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    rows = []
    for j in range(args.slices):
        count.clear()
        t0 = time.perf_counter()
        llm.chat(chats[8 * j: 8 * j + 8], sp, use_tqdm=False)
        rows.append({"slice": j, "seconds": time.perf_counter() - t0, **count})
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"policy": args.policy, "slices": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
