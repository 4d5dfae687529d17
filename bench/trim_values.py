"""What the trim expected of the drafts it kept, against what they turned into.

One fresh in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) runs the short unseen chat
prompts in slices of 8 (64 tokens, 4 at a time, greedy), as `cold_start.py` does. Each draft
the trim keeps is logged with its values (the corrected running products the trim weighed:
expected accepted tokens through each kept position) and matched with what the next step
verified and accepted. Printed per (batch, kept length): drafts, expected and accepted tokens
a draft; and per draft position, the expected and accepted tokens summed. A trim whose deep
drafts make fewer tokens than it valued them at drafts deeper than pays.

Over vLLM's n-gram every draft as proposed is also scored against the tokens its request went
on to make (greedy: a token is accepted exactly when it matches), by fate: kept, trimmed (the
plan's K allowed it, the trim cut it: with the trim's value) or unplanned (past the plan's K).
A trim that cuts tokens worth more than it valued them drafts shorter than pays.

    python bench/trim_values.py [vllm|default] [--slices 3] [--json OUT]

`vllm`: adaptspec over vLLM's n-gram (`bench unseen`'s adaptspec_vllm_ngram); `default`: over
its own n-gram.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
from pathlib import Path
from typing import Any

import engine_ab


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("proposer", nargs="?", default="vllm", choices=("vllm", "default"))
    ap.add_argument("--slices", type=int, default=3)
    ap.add_argument("--model", default=engine_ab.DEFAULT_MODEL)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["ADAPTSPEC_POLICY"] = "default"
    from vllm import SamplingParams

    from adaptspec.tools.bench.prompts import load_unseen_chat

    mode = "adaptspec_vllm" if args.proposer == "vllm" else "adaptspec"
    llm = engine_ab.build(mode, args.model, max_num_seqs=4)
    runtime = llm.llm_engine.engine_core.engine_core.scheduler.runtime
    controller = runtime.controller
    cutting: list[list[str]] = [[]]  # the requests of the cut in progress, in its order
    kept: dict[str, tuple[int, Any, int]] = {}  # request -> (kept length, values, batch)
    by_shape: collections.defaultdict[tuple[int, int], list[float]] = \
        collections.defaultdict(lambda: [0, 0.0, 0.0])
    by_pos: collections.defaultdict[int, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    cut, trim, step = runtime.cut, controller.cost.trim, runtime.step
    # Every draft as proposed, scored afterwards against the tokens the request went on to
    # make (greedy: a draft token is accepted exactly when it matches), so the positions the
    # plan or the trim took away are seen as well as those kept. Over vLLM's n-gram only: its
    # records see each draft before any cut.
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    proposals: list[dict[str, Any]] = []
    open_: dict[str, dict[str, Any]] = {}
    records = scheduler._records
    if records is not None:
        confidence = records.confidence

        def logged_confidence(req_id: str, tokens: Any, draft: Any) -> float:
            entry = {"request": scheduler.requests[req_id], "n": len(tokens),
                     "draft": list(draft), "planned": 0, "kept": 0, "values": None}
            proposals.append(entry)
            open_[req_id] = entry
            return confidence(req_id, tokens, draft)

        records.confidence = logged_confidence

    def logged_cut(req_ids: Any, lengths: Any, confidence: Any) -> Any:
        # (the requests the controller knows, as Runtime.cut passes them on)
        cutting[0] = [r for r in req_ids if controller.slot(r) is not None]
        out = cut(req_ids, lengths, confidence)
        open_.clear()  # (drafts this cut did not trim were not planned: they stay so)
        return out

    def logged_trim(values: Any, keep: Any, batch: int, k_min: Any, slack: Any = None) -> Any:
        out = trim(values, keep, batch, k_min, slack)
        if len(cutting[0]) == values.shape[1]:
            for i, r in enumerate(cutting[0]):
                kept[r] = (int(out[i]), values[: int(out[i]), i].copy(), batch)
                if (entry := open_.pop(r, None)) is not None:
                    entry.update(planned=int(keep[i]), kept=int(out[i]),
                                 values=values[: int(keep[i]), i].copy())
        return out

    def logged_step(req_ids: Any, drafted: Any, accepted: Any, *a: Any, **k: Any) -> Any:
        for r, d, acc in zip(req_ids, drafted, accepted, strict=True):
            entry = kept.pop(r, None)
            if entry is None or not d or entry[0] != d:
                continue  # not verified as kept (the plan's K or a preemption intervened)
            length, values, batch = entry
            row = by_shape[(batch, length)]
            row[0] += 1
            row[1] += float(values.sum())
            row[2] += acc
            for j in range(length):
                by_pos[j][0] += float(values[j])
                by_pos[j][1] += float(acc > j)
        return step(req_ids, drafted, accepted, *a, **k)

    runtime.cut, controller.cost.trim, runtime.step = logged_cut, logged_trim, logged_step
    chats = [[{"role": "user", "content": d["prompt"]}] for d in load_unseen_chat()["short"]]
    llm.chat(chats[:2], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for j in range(args.slices):
        llm.chat(chats[8 * j: 8 * j + 8], sp, use_tqdm=False)
    # per position: [proposed, accepted had it been verified] by fate, and the trim's values
    # of the positions it cut
    fates = ("kept", "trimmed", "unplanned")
    counter: collections.defaultdict[tuple[str, int], list[float]] = \
        collections.defaultdict(lambda: [0, 0, 0.0])
    for e in proposals:
        actual = list(e["request"].all_token_ids)[e["n"]: e["n"] + len(e["draft"])]
        right = next((j for j, (a, d) in enumerate(zip(actual, e["draft"], strict=False))
                      if a != d), min(len(actual), len(e["draft"])))
        for j in range(len(actual)):
            fate = fates[0] if j < e["kept"] else fates[1] if j < e["planned"] else fates[2]
            row = counter[(fate, j)]
            row[0] += 1
            row[1] += j < right
            if fate == "trimmed":
                row[2] += float(e["values"][j])
    counterfactual = [{"fate": f, "position": j, "proposed": int(c), "would_accept": int(a),
                       "valued": v if f == "trimmed" else None}
                      for (f, j), (c, a, v) in sorted(counter.items())]
    shapes = [{"batch": b, "kept": n, "drafts": int(c), "expected": e / c, "accepted": a / c}
              for (b, n), (c, e, a) in sorted(by_shape.items())]
    positions = [{"position": j, "expected": e, "accepted": a}
                 for j, (e, a) in sorted(by_pos.items())]
    print("batch  kept  drafts  expected  accepted   (tokens a draft)")
    for s in shapes:
        if s["drafts"] >= 5:
            print(f"{s['batch']:5d} {s['kept']:5d} {s['drafts']:7d} {s['expected']:9.2f} "
                  f"{s['accepted']:9.2f}")
    print("position  expected  accepted   (tokens, all drafts)")
    for p in positions:
        print(f"{p['position']:8d} {p['expected']:9.1f} {p['accepted']:9.0f}")
    if counterfactual:
        print("fate       position  proposed  would accept  valued   (every draft as proposed)")
        for c in counterfactual:
            valued = "" if c["valued"] is None else f"{c['valued']:8.1f}"
            print(f"{c['fate']:<10} {c['position'] + 1:8d} {c['proposed']:9d} "
                  f"{c['would_accept']:13d} {valued}")
    if args.json:
        args.json.write_text(json.dumps({"proposer": args.proposer, "slices": args.slices,
                                         "shapes": shapes, "positions": positions,
                                         "counterfactual": counterfactual}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
