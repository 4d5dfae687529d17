"""What drafts a configuration verifies, and how each draft position is accepted.

One in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) on the unseen chat prompts (none tuned
on), 4 at a time, greedy, 64 tokens each, after a warm-up batch. Every verification is read
where vLLM's scheduler applies it (`Scheduler.update_from_output`: a draft of d tokens and the
tokens the target sampled), so the numbers are the engine's, whatever chose the drafts.

Prints, and writes as JSON:
- per position j, the conditional acceptance: drafts whose first j tokens were accepted, and
  how many of them had token j accepted too (an n-gram's is far from geometric);
- for adaptspec, the controller's own per-position estimate for each class at the end;
- the drafts' lengths, and at 4 requests the steps by draft tokens (a step's time jumps with its
  token count: bench/step_shapes.py);
- at 4 requests, how many requests had a proposal each step and how many kept it (the cut).

    python bench/acceptance_by_position.py ngram2            # vLLM's n-gram, K=2 (lookup 2-4)
    python bench/acceptance_by_position.py eagle3 --eagle HEAD   # vLLM's eagle, K=3
    python bench/acceptance_by_position.py adaptspec [--policy FILE] [--json OUT]

Wall time is printed but means little: single engines run one after another drift by more
than 10% on a shared machine (use bench/plain_step_ab.py's turn-taking for time).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "~/.cache/adaptspec/models/qwen/draft"


def conditional(hist: dict[tuple[int, int], int]) -> list[tuple[int, int]]:
    """(reached, accepted) per position from {(drafted, accepted): count}: position j is
    reached by drafts of more than j tokens whose first j were accepted."""
    k = max((d for d, _ in hist), default=0)
    out = []
    for j in range(k):
        reached = sum(n for (d, a), n in hist.items() if d > j and a >= j)
        out.append((reached, sum(n for (d, a), n in hist.items() if d > j and a > j)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", help="'ngramK' (vLLM's n-gram, static K), 'eagleK' (vLLM's eagle "
                    "over --eagle HEAD, static K) or 'adaptspec'")
    ap.add_argument("--eagle", default=None, help="an EAGLE head (`adaptspec models eagle`)")
    ap.add_argument("--policy", default="default", help="adaptspec's policy: a file or a "
                    "shipped policy's name")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.mode == "adaptspec":
        os.environ["ADAPTSPEC_POLICY"] = args.policy
    from vllm import LLM, SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler

    from adaptspec.serve import PROPOSERS, SCHEDULER_CLS
    from adaptspec.tools.bench.prompts import load_unseen_chat

    kw: dict[str, Any] = dict(model=os.path.expanduser(args.model), dtype="float32",
                              max_model_len=2048, max_num_seqs=4, enforce_eager=True, seed=0,
                              distributed_executor_backend="uni")
    if args.mode.startswith("ngram"):
        kw["speculative_config"] = {"method": "ngram",
                                    "num_speculative_tokens": int(args.mode[5:]),
                                    "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    elif args.mode.startswith("eagle"):
        if not args.eagle:
            ap.error("eagleK needs --eagle HEAD")
        kw["speculative_config"] = {"method": "eagle", "model": args.eagle,
                                    "num_speculative_tokens": int(args.mode[5:])}
    elif args.mode == "adaptspec":
        kw["scheduler_cls"] = SCHEDULER_CLS
        kw["speculative_config"] = {"method": "custom_class", "model": PROPOSERS["ngram"],
                                    "num_speculative_tokens": 8}
    else:
        ap.error(f"unknown mode {args.mode!r}")
    llm = LLM(**kw)

    hist: collections.Counter = collections.Counter()  # (drafted, accepted)
    shapes: collections.Counter = collections.Counter()  # draft tokens of decode steps at 4
    cut: collections.Counter = collections.Counter()
    update = Scheduler.update_from_output

    def counted(self: Any, so: Any, out: Any) -> Any:
        spec, idx = so.scheduled_spec_decode_tokens, out.req_id_to_index
        drafts = sum(len(v) for v in spec.values())
        n = len(so.num_scheduled_tokens)
        if n == 4 and so.total_num_scheduled_tokens == n + drafts:  # no prefill in it
            shapes[drafts] += 1
        for r, toks in spec.items():
            if toks and r in idx:
                hist[(len(toks), max(len(out.sampled_token_ids[idx[r]]) - 1, 0))] += 1
        return update(self, so, out)

    Scheduler.update_from_output = counted
    if args.mode == "adaptspec":
        import adaptspec_vllm.scheduler as sched  # (after the engine: see docs/development.md)
        take = sched._Adaptive.update_draft_token_ids

        def cut_counted(self: Any, dt: Any) -> None:
            proposed = [len(x) for x in dt.draft_token_ids]
            take(self, dt)
            if len(self.running) == 4:
                kept = [len(self.requests[r].spec_token_ids) for r in dt.req_ids
                        if r in self.requests]
                cut.update(steps=1, proposed=sum(p > 0 for p in proposed),
                           kept=sum(k > 0 for k in kept), proposed_tokens=sum(proposed),
                           kept_tokens=sum(kept))

        sched._Adaptive.update_draft_token_ids = cut_counted

    chats = [[{"role": "user", "content": d["prompt"]}]
             for d in load_unseen_chat()["short"][: args.prompts]]
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    llm.chat(chats[:4], sp, use_tqdm=False)
    for c in (hist, shapes, cut):
        c.clear()
    t0 = time.perf_counter()
    llm.chat(chats, sp, use_tqdm=False)
    wall = time.perf_counter() - t0

    cond = conditional(hist)
    lengths = collections.Counter()
    for (d, _), n in hist.items():
        lengths[d] += n
    res: dict[str, Any] = {
        "mode": args.mode, "policy": os.environ.get("ADAPTSPEC_POLICY"), "wall_s": wall,
        "drafts": sum(hist.values()), "draft_tokens": sum(d * n for (d, _), n in hist.items()),
        "accepted": sum(a * n for (_, a), n in hist.items()),
        "conditional_acceptance": [{"position": j, "reached": r, "accepted": a}
                                   for j, (r, a) in enumerate(cond)],
        "draft_lengths": dict(sorted(lengths.items())),
        "steps_at_4_by_draft_tokens": dict(sorted(shapes.items())),
        "cut_at_4": {k: v / max(cut["steps"], 1) for k, v in cut.items() if k != "steps"},
    }
    if args.mode == "adaptspec":
        ctl = llm.llm_engine.engine_core.engine_core.scheduler.runtime.controller
        # rows: the first proposer's classes first (its own n-gram is the only one here)
        res["estimate"] = {name: [round(float(x), 3) for x in row] for name, row in
                           zip(ctl.class_names, ctl.estimator.mean(), strict=False)}
    print(f"{args.mode}: {wall:.1f} s; drafts {res['drafts']}, draft tokens "
          f"{res['draft_tokens']}, accepted {res['accepted']}")
    print("conditional acceptance by position:",
          " ".join(f"{a / r:.2f} ({r})" if r else "- (0)" for r, a in cond))
    for name, row in res.get("estimate", {}).items():
        print(f"  controller's estimate, {name}: {' '.join(f'{x:.2f}' for x in row)}")
    print("draft lengths:", res["draft_lengths"])
    print("steps at 4 requests by draft tokens:", res["steps_at_4_by_draft_tokens"])
    if cut:
        print("at 4 requests, per step:", {k: round(v, 2) for k, v in res["cut_at_4"].items()})
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
