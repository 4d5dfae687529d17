"""The self-draft measured on the benchmark's prompts (the Qwen pair's figures).

``python -m adaptspec.tools.bench.selfdraft_measure`` measures, per N, agreement with and
without the exit adapter per benchmark class on the target's own greedy continuations of chat
prompts (adaptspec.tools.bench.workload), plus a separate draft model for comparison, and the
cost of a pass (adaptspec.tools.models.selfdraft_auto), and writes a JSON
(bench/results/selfdraft_qwen.json). Calibration is the stdlib text, as for the builder
(adaptspec.tools.models.selfdraft); the evaluation prompts are the benchmark's, so the two never
overlap.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from adaptspec.tools.bench.workload import class_prompts, load_sources, render
from adaptspec.tools.models import selfdraft as sd
from adaptspec.tools.models.selfdraft_auto import (
    COST_PROMPT,
    COST_REPEATS,
    COST_STEPS,
    decode_step_seconds,
    expected_speedup,
)

CLASSES = ("code", "math", "writing", "translation")


def greedy_with_states(model: Any, prompt: Any, new_tokens: int, layers: list[int]
                       ) -> tuple[list[int], dict[int, Any]]:
    """The target's greedy continuation of ``prompt`` ([1, p]) and, for every position that
    predicted one of its tokens, ``norm(h_N)`` per N in ``layers`` (KV cache, one pass)."""
    import torch
    from transformers.cache_utils import DynamicCache

    cache, ids, inp = DynamicCache(), [], prompt
    states: dict[int, list[Any]] = {n: [] for n in layers}
    with torch.no_grad():
        for _ in range(new_tokens):
            out = model.model(input_ids=inp, past_key_values=cache, use_cache=True,
                              output_hidden_states=True)
            for n in layers:
                states[n].append(model.model.norm(out.hidden_states[n][:, -1]))
            nxt = int(model.lm_head(out.last_hidden_state[:, -1]).argmax(-1))
            ids.append(nxt)
            inp = torch.tensor([[nxt]])
    return ids, {n: torch.cat(v) for n, v in states.items()}


def measure(target: Path, sibling: Path | None, layers: list[int], prompts_per_class: int,
            new_tokens: int, calibration_tokens: int, k: int, progress: sd.Progress,
            threads: int = sd.THREADS) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t_start = time.monotonic()
    info = sd.inspect_target(target)
    for n in layers:
        sd.check_layers(info, n)
    tok = AutoTokenizer.from_pretrained(info.path)
    calib, calib_info = sd.calibration_windows(tok, None, calibration_tokens)
    n_val = max(1, len(calib) // 8) * sd.WINDOW
    prompts = class_prompts(load_sources())
    res: dict[str, Any] = {
        "target": str(info.path), "sibling": str(sibling) if sibling else None,
        "calibration": {**calib_info, "fit_tokens": calib.numel() - n_val,
                        "validation_tokens": n_val},
        "evaluation": {"classes": list(CLASSES), "prompts_per_class": prompts_per_class,
                       "new_tokens": new_tokens,
                       "text": "the target's greedy continuation of the first prompts of each "
                               "class (adaptspec.tools.bench.workload.class_prompts, chat "
                               "template), teacher-forced"},
        "k": k, "threads": threads, "dtype": "float32"}
    with sd.torch_threads(threads):
        model = sd.load_target(info.path)
        head = model.lm_head.weight.detach()
        t0 = time.monotonic()
        x, y, pred = sd.collect_states(model, calib, layers)
        adapters, fits = {}, {}
        for n in layers:
            adapters[n], fits[n] = sd.fit_adapter(x[n], y, head, pred, n_val)
            fits[n]["validation_agreement_plain"] = round(
                sd.agreement(head, x[n][-n_val:], pred[-n_val:]), 4)
        del x, y
        res["calibration"]["seconds"] = round(time.monotonic() - t0, 1)
        progress(f"calibrated in {res['calibration']['seconds']} s: {fits}")
        t0 = time.monotonic()
        gen: dict[str, list[tuple[Any, list[int], dict[int, Any]]]] = {}
        for cls in CLASSES:
            gen[cls] = []
            for msg in prompts[cls][:prompts_per_class]:
                ids = tok(render(tok, msg), add_special_tokens=False, return_tensors="pt")
                cont, states = greedy_with_states(model, ids["input_ids"], new_tokens, layers)
                gen[cls].append((ids["input_ids"], cont, states))
            progress(f"generated {cls} ({time.monotonic() - t0:.0f} s)")
        res["evaluation"]["seconds"] = round(time.monotonic() - t0, 1)
        rows: dict[str, dict[str, Any]] = {}
        for n in layers:
            for name, w in ((f"N={n}", None), (f"N={n} + adapter", adapters[n])):
                per_cls = {}
                for cls, items in gen.items():
                    hits = [float((sd.head_argmax(head, st[n], w) == torch.tensor(c)).sum())
                            for _, c, st in items]
                    per_cls[cls] = round(sum(hits) / sum(len(c) for _, c, _ in items), 4)
                rows[name] = {"layers": n, "adapter": w is not None, "agreement": per_cls,
                              **({"fit": fits[n]} if w is not None else {})}
        timed: dict[str, tuple[Any, int | None]] = {"target": (model, None)}
        timed.update({f"N={n}": (model, n) for n in layers})
        progress("timing decode steps")
        prompt = gen[CLASSES[0]][0][0][:, :COST_PROMPT]
        secs = decode_step_seconds(timed, prompt)
        for n in layers:
            rows[f"N={n}"]["cost_ratio"] = rows[f"N={n} + adapter"]["cost_ratio"] = round(
                secs[f"N={n}"] / secs["target"], 4)
        res["target_step_ms"] = round(secs["target"] * 1e3, 1)
        if sibling is not None:
            # Memory: the target's layers past the deepest N go before the sibling comes in;
            # the sibling is timed beside that N, and priced through N's ratio to the target.
            deepest = max(layers)
            model.model.layers = torch.nn.ModuleList(list(model.model.layers)[:deepest])
            model.config.num_hidden_layers = deepest
            gc.collect()
            sib = AutoModelForCausalLM.from_pretrained(sibling, dtype=torch.float32).eval()
            per_cls = {}
            with torch.no_grad():
                for cls, items in gen.items():
                    hit = total = 0
                    for p, c, _ in items:
                        seq = torch.cat([p, torch.tensor([c[:-1]])], 1)
                        got = sib(input_ids=seq).logits[0, p.shape[1] - 1:].argmax(-1)
                        hit += int((got == torch.tensor(c)).sum())
                        total += len(c)
                    per_cls[cls] = round(hit / total, 4)
            progress("timing the sibling")
            pair = decode_step_seconds({"deep": (model, None), "sibling": (sib, None)}, prompt)
            rows["sibling"] = {
                "layers": sib.config.num_hidden_layers, "adapter": False, "agreement": per_cls,
                "cost_ratio": round(pair["sibling"] / pair["deep"] * secs[f"N={deepest}"]
                                    / secs["target"], 4),
                "cost_via": f"timed beside N={deepest}: {pair['sibling'] * 1e3:.1f} ms vs "
                            f"{pair['deep'] * 1e3:.1f} ms"}
    for row in rows.values():
        row["mean_agreement"] = round(statistics.mean(row["agreement"].values()), 4)
        row["expected_speedup"] = round(expected_speedup(row["mean_agreement"],
                                                         row["cost_ratio"], k), 4)
    res["rows"] = rows
    res["timing"] = {"prompt_tokens": COST_PROMPT, "steps": COST_STEPS, "repeats": COST_REPEATS,
                     "load_average_after": [round(v, 2) for v in os.getloadavg()]}
    res["seconds"] = round(time.monotonic() - t_start, 1)
    return res


def table(res: dict[str, Any]) -> str:
    k = res["k"]
    lines = ["| draft | " + " | ".join(CLASSES) + f" | mean | cost per pass | expected "
             f"speedup, K={k} |", "|---" * (len(CLASSES) + 4) + "|"]
    for name, row in res["rows"].items():
        label = f"sibling draft, {row['layers']} layers" if name == "sibling" else name
        lines.append(f"| {label} | " + " | ".join(f"{row['agreement'][c]:.2f}" for c in CLASSES)
                     + f" | {row['mean_agreement']:.2f} | {row['cost_ratio']:.2f} | "
                     f"{row['expected_speedup']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m adaptspec.tools.bench.selfdraft_measure",
                                 description="self-draft agreement and cost per N on a real pair")
    ap.add_argument("target", type=Path)
    ap.add_argument("--sibling", type=Path, default=None, help="a separate draft to compare")
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 12, 16])
    ap.add_argument("--prompts", type=int, default=3, help="prompts per class")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--calibration-tokens", type=int, default=4096)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--threads", type=int, default=sd.THREADS)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        res = measure(args.target, args.sibling, args.layers, args.prompts, args.new_tokens,
                      args.calibration_tokens, args.k,
                      lambda m: print(m, file=sys.stderr, flush=True), args.threads)
    except sd.SelfDraftError as e:
        print(f"selfdraft_measure: {e}", file=sys.stderr)
        return 2
    print(table(res))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
