"""A fresh engine's first minutes: what it drafts, cuts and gets accepted, slice by slice.

One in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) runs the short unseen chat prompts in
slices of 8 (64 tokens, 4 at a time, greedy) after `bench unseen`'s warm-up (two of them, 8
tokens), and counts per slice: engine steps, draft tokens proposed, kept after the plan's K,
kept after the confidence cut, verified and accepted, how many of the cut's decisions used a
calibrated confidence bin and how many only ranked drafts by an uncalibrated one
(Controller.cut), and by draft position the drafts that reached it and those accepted through
it (`reached_j`, `accepted_j`). Also per slice: the steps each request took (`request_steps`,
sorted), the steps that ran fewer requests than the engine's batch (`short_steps`), and per
draft-token count of the decode steps at the full batch their median ms and, on an adaptive
engine, what its step-time model predicts for them at the slice's end (`full_batch_ms`).

A slice ends with its slowest request, so a configuration that saves request steps off the
slowest one's path turns them into short steps, and the slice takes as many steps as before.
Wall times of engines run one after another move with the machine (10% between runs here);
steps, drafts and acceptance do not.

    python bench/cold_start.py [default|k2|vllm|ngram2] [--slices 4] [--json OUT]
        [--policy-file POLICY] [--lc]

With --lc each slice also carries one latency-critical request (a quick turn of 16 tokens, class
`interactive`, first in the slice, as `bench unseen`'s), on an engine of 5 sequences; the steps
it shares with 4 others (`lc_*`: proposed, kept after the plan's K and after the cut, and per
draft count their median ms) and, on an adaptive engine, what its step-time model predicts at
the slice's end for 5 requests with 0-2 drafts (`lc_predicted_ms`) say why they draft or not.
(Once it finished the others run 5 at a time, unlike `bench unseen`'s 4 clients, so the other
counts of an --lc run compare only with another --lc run's.)

`k2` is `bench unseen`'s adaptspec_k2: the same machinery drafting K=2 whatever it learned.
`vllm` is adaptspec over vLLM's n-gram (adaptspec_vllm_ngram), `ngram2` vLLM's static n-gram
K=2 alone (vllm_ngram_k2: no controller, so the plan's and the cut's counts are absent).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import engine_ab  # noqa: E402  (the engines the A/B builds: same model, sizes and proposer)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("policy", nargs="?", default="default",
                    choices=("default", "k2", "vllm", "ngram2"))
    ap.add_argument("--slices", type=int, default=4)
    ap.add_argument("--model", default=engine_ab.DEFAULT_MODEL)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--lc", action="store_true",
                    help="a latency-critical request in every slice, beside the others")
    ap.add_argument("--policy-file", default=None,
                    help="the adaptive engines' policy (default: the shipped one)")
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    policy = args.policy_file or "default"
    if args.policy == "k2":
        from adaptspec.tools.bench.unseen import fixed_k2_policy

        policy = str(fixed_k2_policy(Path(tempfile.mkdtemp())))
    if args.policy == "ngram2":
        # (a policy in the environment makes vLLM's default scheduler adaptspec's)
        os.environ.pop("ADAPTSPEC_POLICY", None)
    else:
        os.environ["ADAPTSPEC_POLICY"] = policy
    import numpy as np
    from vllm import SamplingParams

    from adaptspec.account import step_shape
    from adaptspec.tools.bench.prompts import load_unseen_chat
    from adaptspec.tools.bench.workload import LATENCY_CRITICAL

    mode = {"vllm": "adaptspec_vllm", "ngram2": "ngram2"}.get(args.policy, "adaptspec")
    main_batch = 4
    llm = engine_ab.build(mode, args.model, max_num_seqs=main_batch + int(args.lc))
    data = load_unseen_chat()
    chats = [[{"role": "user", "content": d["prompt"]}] for d in data["short"]]
    quick = [[{"role": "user", "content": q}] for q in data["interactive"]]
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    count: collections.Counter[str] = collections.Counter()
    update_drafts, update_output = sched.update_draft_token_ids, sched.update_from_output
    runtime = getattr(sched, "runtime", None)  # (None: vLLM's own scheduler)
    request_steps: collections.Counter[str] = collections.Counter()
    # Decode steps at the main batch: draft tokens -> ms of each (schedule, model, update);
    # with --lc also those beside the latency-critical request.
    full_ms: collections.defaultdict[int, list[float]] = collections.defaultdict(list)
    lc_ms: collections.defaultdict[int, list[float]] = collections.defaultdict(list)
    # (draft tokens, whether only decodes, whether beside a latency-critical request, batch)
    # of the step running
    shape: list[Any] = [None]
    step_fn = core.step_fn

    def timed_step() -> Any:
        t0 = time.perf_counter()
        out = step_fn()
        if shape[0] is not None and shape[0][1]:
            drafted, _, beside, batch = shape[0]
            ms = (time.perf_counter() - t0) * 1e3
            if beside:
                lc_ms[drafted].append(ms)
            elif batch == main_batch:
                full_ms[drafted].append(ms)
        shape[0] = None
        return out

    def critical(req_id: str) -> bool:
        r = sched.requests.get(req_id)
        extra = getattr(getattr(r, "sampling_params", None), "extra_args", None) or {}
        return extra.get("adaptspec_class") == LATENCY_CRITICAL

    def counted_drafts(dt: Any) -> None:
        if runtime is None:
            update_drafts(dt)
            return
        plan = runtime.plan_for(dt.req_ids)
        pre = "lc_" if any(map(critical, dt.req_ids)) else ""
        count[pre + "proposed"] += sum(len(x) for x in dt.draft_token_ids)
        count[pre + "after_k"] += sum(min(len(x), plan.k_of(r)) for r, x in
                                      zip(dt.req_ids, dt.draft_token_ids, strict=True))
        count[pre + "drafts_proposed"] += sum(len(x) > 0 for x in dt.draft_token_ids)
        count[pre + "drafts_after_k"] += sum(min(len(x), plan.k_of(r)) > 0 for r, x in
                                             zip(dt.req_ids, dt.draft_token_ids, strict=True))
        update_drafts(dt)
        count[pre + "after_cut"] += sum(len(sched.requests[r].spec_token_ids)
                                        for r in dt.req_ids if r in sched.requests)
        count[pre + "drafts_after_cut"] += sum(len(sched.requests[r].spec_token_ids) > 0
                                               for r in dt.req_ids if r in sched.requests)

    def counted_output(so: Any, out: Any) -> Any:
        count["steps"] += 1
        request_steps.update(so.num_scheduled_tokens.keys())
        step = step_shape(so)  # (the engine account's reading of a step)
        beside = any(map(critical, so.num_scheduled_tokens))
        shape[0] = (step["drafted"], not step["prefill"], beside, step["batch"])
        count["short_steps"] += step["batch"] < main_batch
        count["lc_steps"] += beside
        for rid, d in so.scheduled_spec_decode_tokens.items():
            i = out.req_id_to_index.get(rid)
            if d and i is not None:
                a = len(out.sampled_token_ids[i]) - 1
                count["verified"] += len(d)
                count["accepted"] += a
                for j in range(len(d)):
                    count[f"reached_{j}"] += 1
                    count[f"accepted_{j}"] += j < a
        return update_output(so, out)

    def counted_shift(rows: Any, conf: Any) -> Any:
        s = shift(rows, conf)
        count["cut_calibrated"] += int(np.isfinite(s).sum())
        count["cut_uncalibrated"] += int((~np.isfinite(s)).sum())
        return s

    sched.update_draft_token_ids, sched.update_from_output = counted_drafts, counted_output
    core.step_fn = timed_step
    if runtime is not None:
        calibration = runtime.controller.confidence
        shift = calibration.shift
        calibration.shift = counted_shift
    llm.chat(chats[:2], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    lc_sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                           extra_args={"adaptspec_class": LATENCY_CRITICAL})
    rows = []
    for j in range(args.slices):
        count.clear()
        request_steps.clear()
        full_ms.clear()
        lc_ms.clear()
        batch = chats[8 * j: 8 * j + 8]
        params = [sp] * len(batch)
        if args.lc:
            batch, params = [quick[j % len(quick)], *batch], [lc_sp, *params]
        t0 = time.perf_counter()
        llm.chat(batch, params, use_tqdm=False)
        row = {"slice": j, "seconds": time.perf_counter() - t0, **count,
               "request_steps": sorted(request_steps.values()),
               "full_batch_ms": step_costs(full_ms, runtime, main_batch)}
        if args.lc:
            row["lc_batch_ms"] = step_costs(lc_ms, runtime, main_batch + 1)
            if runtime is not None:
                cost = runtime.controller.cost
                row["lc_predicted_ms"] = {s: cost.predict(main_batch + 1, s, s) for s in range(3)}
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"policy": args.policy, "policy_file": args.policy_file,
                                         "lc": args.lc, "slices": rows}, indent=1))
    return 0


def step_costs(measured: dict[int, list[float]], runtime: Any, batch: int
               ) -> dict[str, dict[str, float]]:
    """Per draft-token count of the slice's decode steps of `batch` requests: the measured
    median ms and how many steps, and (adaptive engines) what the controller's step-time
    model predicts for that shape now, its longest draft taken as min(S, the engine's K)."""
    out = {}
    for spec in sorted(measured):
        row = {"ms": statistics.median(measured[spec]), "steps": len(measured[spec])}
        if runtime is not None:
            controller = runtime.controller
            row["predicted_ms"] = controller.cost.predict(batch, spec, min(spec, controller.k_cap))
        out[str(spec)] = row
    return out


if __name__ == "__main__":
    sys.exit(main())
