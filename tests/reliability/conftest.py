"""Shared engines for the reliability tests.

Engine starts dominate the run time on a 2-core machine, so every offline engine these tests need
is started once, in the background, as soon as the session begins (two processes, each running
its engines one after another), and the `adaptspec serve` instance for the load tests starts
beside them; tests then wait only for the results they read. `tiny_models`: tests/conftest.py.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _fuzz import TRIED
from _rel import (
    CLIENTS,
    FAULT_SPEC,
    GREEDY_TOKENS,
    LOAD_POLICY_EXTRA,
    LONG,
    LONG_EXTRA_PROMPTS,
    LONG_LOAD_FAULT,
    N_SAMPLES,
    Server,
)
from stdlib_prompts import code_prompts
from tiny_serving import policy_text, serve_command

from adaptspec.serve import PROPOSERS, free_port

TRUNCATED_SNAPSHOT = '{"format": "adaptspec-state", "version": 1, "classes": {"code": {"su'

_ENGINE_FIXTURES = {"engines", "load_server"}


@pytest.hookimpl(trylast=True)  # after -k/-m deselection
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    config._adaptspec_rel_uses = {  # type: ignore[attr-defined]
        f for it in items if Path(str(it.path)).is_relative_to(here)
        for f in getattr(it, "fixturenames", ()) if f in _ENGINE_FIXTURES
    }


@pytest.fixture(scope="session", autouse=True)
def _start_engines_early(request: pytest.FixtureRequest) -> None:
    """Start the shared engines (only those some selected test uses) before the first test."""
    if importlib.util.find_spec("vllm") is None:
        return  # the tests that need them skip themselves
    for name in sorted(getattr(request.config, "_adaptspec_rel_uses", ())):
        request.getfixturevalue(name)


@pytest.fixture(scope="module", autouse=True)
def _fuzz_report() -> Iterator[None]:
    """The inputs a bad-input module tried (_fuzz.TRIED), printed after it (`-s` shows them)."""
    TRIED.clear()
    yield
    if TRIED:
        print(f"\nbad input: {sum(TRIED.values())} inputs tried: "
              + ", ".join(f"{k} {v}" for k, v in sorted(TRIED.items())))


@pytest.fixture(scope="session")
def rel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("reliability")


@pytest.fixture(scope="session")
def prompts(tiny_models: dict) -> dict[str, Any]:
    """Greedy prompts for load and faults (code + random tokens) and the sampling prompt."""
    tok = Path(tiny_models["target"]) / "tokenizer.json"
    code = code_prompts(tok, 35)
    rng = np.random.default_rng(7)
    noisy = [rng.integers(3, 4000, size=40).tolist() for _ in range(8)]
    greedy = code[:32] + noisy
    if LONG:  # distinct prompts from the modules below the top level too
        seen = {tuple(p) for p in greedy}
        more = [p for p in code_prompts(tok, LONG_EXTRA_PROMPTS + 64, recursive=True)
                if tuple(p) not in seen]
        greedy += more[:LONG_EXTRA_PROMPTS]
    # The sampling prompt is where the tiny draft disagrees most with the target on token 3
    # (the first token a draft decides: a request's first decode step runs at K=0), so that a
    # broken acceptance rule shows: among code prompts 32-59, the exact marginals give a
    # two-sample chi-square noncentrality of about 400 at 2,000 samples a side for prompt 34,
    # 125 for prompt 32 (used before; one CI run's broken sampler scored only p=1.7e-6 there).
    return {"greedy": greedy, "sample": code[34][:32]}


class Engines:
    """The offline engines, in two processes started at once (an engine core in-process uses
    one core; this machine has two), each running its engines one after another."""

    def __init__(self, groups: dict[str, dict[str, tuple[dict, dict[str, str]]]],
                 folder: Path) -> None:
        from adaptspec_vllm.run_engine import EngineRuns

        self._runs = {label: EngineRuns(folder, label, [
            {"name": name, **cfg, "env": env} for name, (cfg, env) in specs.items()])
            for label, specs in groups.items()}
        self._where = {name: label for label, specs in groups.items() for name in specs}

    def __getitem__(self, name: str) -> dict[str, Any]:
        res = self._runs[self._where[name]].results()[name]
        assert res["error"] is None, f"engine {name} failed\n{res['error']}"
        return res

    def close(self) -> None:
        for run in self._runs.values():
            run.kill()


@pytest.fixture(scope="session")
def engines(tiny_models: dict, prompts: dict, rel_dir: Path) -> Iterator[Engines]:
    folder = rel_dir / "engines"
    folder.mkdir()
    target, draft = tiny_models["target"], tiny_models["draft"]
    greedy = {"prompts": prompts["greedy"], "max_tokens": GREEDY_TOKENS, "temperature": 0.0,
              "class": "code"}

    def samples(seed: int) -> dict:
        return {"prompts": [prompts["sample"]] * N_SAMPLES, "max_tokens": 3,
                "temperature": 1.0, "seed": seed, "class": "code"}

    def policy(name: str, **extra: Any) -> str:
        p = folder / f"{name}.yaml"
        p.write_text(policy_text(**extra))
        return str(p)

    # probabilistic drafts: q is the draft model's distribution, not one-hot (vLLM's default
    # drafts greedily and verifies as if q were one-hot)
    draft_spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
                  "draft_sample_method": "probabilistic"}
    ngram_spec = {"method": "custom_class", "model": PROPOSERS["ngram"],
                  "num_speculative_tokens": 4}
    hybrid_policy = folder / "hybrid.yaml"
    hybrid_policy.write_text(policy_text(exploration=0.5))
    # A snapshot folder nobody can write, root included: a path below a regular file.
    (folder / "not-a-dir").write_text("x")
    batch_plain = max(64, min(256, N_SAMPLES))
    # room for every running request's whole prompt in one step (see adaptspec_vllm/run_engine.py)
    nbt = batch_plain * (len(prompts["sample"]) + 8)
    specs: dict[str, tuple[dict, dict[str, str]]] = {
        "plain": ({"model": target, "spec": None, "adaptive": False, "max_num_seqs": batch_plain,
                   "max_num_batched_tokens": nbt,
                   "batches": {"greedy": greedy, "samples": samples(0)}}, {}),
        # adaptspec (draft model) under faults: a controller raising every 7th step and taking
        # 50 ms a step, metrics failing every 5th write, every snapshot read and write failing.
        # Greedy outputs must stay identical and sampled ones the target's distribution.
        # (One engine for all of it: engine starts are what this machine cannot afford.)
        "adaptive": ({"model": target, "spec": draft_spec, "adaptive": True,
                      "max_num_seqs": batch_plain, "max_num_batched_tokens": nbt,
                      "batches": {"greedy": greedy, "samples": samples(1_000_000)}},
                     {"ADAPTSPEC_POLICY": policy(
                         "adaptive", state_file=str(folder / "not-a-dir" / "state.json"),
                         snapshot_interval_s=0.5),
                      "ADAPTSPEC_FAULT": FAULT_SPEC}),
        "broken": ({"model": target, "spec": draft_spec, "adaptive": True,
                    "max_num_seqs": batch_plain, "max_num_batched_tokens": nbt,
                    "batches": {"samples": samples(2_000_000)}},
                   {"ADAPTSPEC_POLICY": policy("broken"),
                    "ADAPTSPEC_TEST_BROKEN_SAMPLER": "accept_all"}),
        # The hybrid with the draft model, exploring, so that its three proposers draft side
        # by side in the same batches.
        "hybrid": ({"model": target, "spec": {"method": "custom_class",
                                              "model": PROPOSERS["hybrid"],
                                              "num_speculative_tokens": 3},
                    "adaptive": True, "max_num_seqs": batch_plain, "max_num_batched_tokens": nbt,
                    "batches": {"samples": samples(6_000_000)}},
                   {"ADAPTSPEC_POLICY": str(hybrid_policy),
                    "ADAPTSPEC_DRAFT_MODEL": draft}),
    }
    if LONG:
        specs["ngram_ok"] = ({"model": target, "spec": ngram_spec, "adaptive": True,
                              "max_num_seqs": batch_plain, "max_num_batched_tokens": nbt,
                              "batches": {"samples": samples(3_000_000)}},
                             {"ADAPTSPEC_POLICY": policy("ngram_ok")})
        specs["ngram_broken"] = ({"model": target, "spec": ngram_spec, "adaptive": True,
                                  "max_num_seqs": batch_plain, "max_num_batched_tokens": nbt,
                                  "batches": {"samples": samples(4_000_000)}},
                                 {"ADAPTSPEC_POLICY": policy("ngram_broken"),
                                  "ADAPTSPEC_TEST_BROKEN_SAMPLER": "accept_all"})
        specs["draft_lenient"] = ({"model": target, "spec": draft_spec, "adaptive": True,
                                   "max_num_seqs": batch_plain, "max_num_batched_tokens": nbt,
                                   "batches": {"samples": samples(5_000_000)}},
                                  {"ADAPTSPEC_POLICY": policy("draft_lenient"),
                                   "ADAPTSPEC_TEST_BROKEN_SAMPLER": "lenient"})
    # the faulted engine alone in its process: test_faults.py counts faults in its log
    eng = Engines({"faulted": {"adaptive": specs.pop("adaptive")}, "others": specs}, folder)
    yield eng
    eng.close()


# ------------------------------------------------------------------------------ the server



@pytest.fixture(scope="session")
def load_server(tiny_models: dict, rel_dir: Path) -> Iterator[Server]:
    """`adaptspec serve` on the tiny pair, as the issue asks: dynamic classes capped at 8."""
    folder = rel_dir / "server"
    folder.mkdir()
    state = folder / "state" / "learned.json"
    state.parent.mkdir()
    # a truncated snapshot, as a crash of a non-atomic writer would leave it: ignored with a
    # warning and counted at start, then replaced by complete ones
    state.write_text(TRUNCATED_SNAPSHOT)
    os.chmod(state, 0o644)
    pol = folder / "load.yaml"
    pol.write_text(policy_text(**LOAD_POLICY_EXTRA, state_file=str(state)))
    port = free_port()
    # SIGTERM drains in-flight requests for up to 60 s instead of aborting them
    cmd = serve_command(tiny_models["target"], str(pol), port, "--shutdown-timeout", "60",
                        max_num_seqs=CLIENTS)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("ADAPTSPEC_FAULT", None)
    if LONG:
        env["ADAPTSPEC_FAULT"] = LONG_LOAD_FAULT
    srv = Server(cmd, folder / "server.log", env, port)
    srv.state_file = state  # type: ignore[attr-defined]
    srv.policy_file = pol  # type: ignore[attr-defined]
    try:
        yield srv
    finally:
        if srv.proc.poll() is None:
            srv.kill_group()

