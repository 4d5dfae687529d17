"""Run one real vLLM engine configuration over a prompt file and write what it produced.

Used by the plugin tests and the benchmarks, in a subprocess per configuration: vLLM's engine
core needs a __main__ guard, and a fresh process per engine keeps runs independent.
Prometheus multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set by the caller) carries the engine
core's adaptspec_* series out to the caller, which reads the folder after this process exits.

usage: python -m adaptspec_vllm.run_engine CONFIG.json OUT.json
CONFIG: {"model", "prompts": [[token ids]...], "classes": [...], "max_tokens", "spec": {...}|null,
         "adaptive": bool, "temperature": float, "temperatures": [float per prompt] (optional),
         "seed": int|null, "max_num_seqs": int, "repeats": int, "dtype", "max_model_len"}
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    cfg = json.loads(open(sys.argv[1]).read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=cfg["model"], dtype=cfg.get("dtype", "float32"),
              max_model_len=cfg.get("max_model_len", 512),
              max_num_seqs=cfg.get("max_num_seqs", 8), enforce_eager=True,
              disable_log_stats=False, seed=0)
    if cfg.get("spec"):
        kw["speculative_config"] = cfg["spec"]
    if cfg.get("adaptive"):
        kw["scheduler_cls"] = "adaptspec_vllm.scheduler.AdaptiveScheduler"
    llm = LLM(**kw)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in cfg["prompts"]]
    temps = cfg.get("temperatures") or [cfg.get("temperature", 0.0)] * len(prompts)
    params = [
        SamplingParams(max_tokens=cfg["max_tokens"], temperature=temps[i],
                       seed=None if cfg.get("seed") is None else cfg["seed"] + i,
                       ignore_eos=True, extra_args={"adaptspec_class": c})
        for i, c in enumerate(cfg["classes"])
    ]
    repeat_seconds = []
    for _ in range(cfg.get("repeats", 1)):  # same prompts again: medians, and a warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        repeat_seconds.append(time.perf_counter() - t0)
    spec = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            spec[m.name] = getattr(m, "values", None) or getattr(m, "value", None)
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "seconds": repeat_seconds[-1],
        "repeat_seconds": repeat_seconds,
        "spec": spec,
    }
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
