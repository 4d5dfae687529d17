"""One real vLLM engine, several batches of requests, one JSON result (a subprocess per engine).

usage: python tests/reliability/engine_job.py CONFIG.json OUT.json

CONFIG: {"model", "spec": {...}|null, "adaptive": bool, "max_num_seqs": int,
         "batches": {NAME: {"prompts": [[ids]...], "max_tokens": int, "temperature": float,
                            "seed": int|null (request i gets seed + i), "class": str}}}
OUT: {"batches": {NAME: {"tokens": [[ids]...], "seconds": float}}, "spec": {vllm:spec_decode_*}}

Unlike adaptspec_vllm.run_engine this runs several batches (a greedy reference and thousands of
seeded samples) in one engine, so a test pays for one engine start instead of several.
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

    kw = dict(model=cfg["model"], dtype="float32", max_model_len=cfg.get("max_model_len", 512),
              max_num_seqs=cfg.get("max_num_seqs", 32), enforce_eager=True,
              disable_log_stats=False, seed=0,
              distributed_executor_backend=cfg.get("executor", "uni"))
    if cfg.get("max_num_batched_tokens"):
        # Seeded requests must not have their prefill chunked: vLLM 0.32's CPU runner then
        # calls Generator.set_offset, which CPU generators refuse (RuntimeError).
        kw["max_num_batched_tokens"] = cfg["max_num_batched_tokens"]
    if cfg.get("spec"):
        kw["speculative_config"] = cfg["spec"]
    if cfg.get("adaptive"):
        kw["scheduler_cls"] = "adaptspec_vllm.scheduler.AdaptiveScheduler"
    llm = LLM(**kw)
    result: dict = {"batches": {}}
    for name, b in cfg["batches"].items():
        prompts = [TokensPrompt(prompt_token_ids=p) for p in b["prompts"]]
        seed = b.get("seed")
        params = [
            SamplingParams(max_tokens=b["max_tokens"], temperature=b.get("temperature", 0.0),
                           seed=None if seed is None else seed + i, ignore_eos=True,
                           extra_args={"adaptspec_class": b.get("class", "code")})
            for i in range(len(prompts))
        ]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        result["batches"][name] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                                   "seconds": time.perf_counter() - t0}
    spec = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            spec[m.name] = getattr(m, "values", None) or getattr(m, "value", None)
    result["spec"] = spec
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
