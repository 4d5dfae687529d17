"""`adaptspec bench decide`: how long one controller step takes, by batch size."""

from __future__ import annotations

import time

import numpy as np

from adaptspec.controller import Controller
from adaptspec.policy import Policy


def time_decisions(policy: Policy, batch: int, repeats: int = 2000, seed: int = 0,
                   speculating: bool = False) -> dict:
    """Median and p99 time of one controller step (feedback + decision) for a batch. Wall time
    (median_us, p99_us) and the thread's CPU time (cpu_median_us, cpu_p99_us): on a shared
    machine the wall clock also counts the time other processes hold the core, the CPU clock
    only the controller's own work.

    Requests cycle through the policy's classes; `speculating` leaves the latency-critical
    ones out, so that (where the cost model allows) the batch drafts and feeds back every step
    rather than being held at K = 0 by a latency-critical request."""
    rng = np.random.default_rng(seed)
    ctl = Controller(policy, seed=seed)
    names = [n for n, c in policy.classes.items() if not (speculating and c.latency_critical)]
    slots = np.array([ctl.add_request(f"r{i}", names[i % len(names)]) for i in range(batch)])
    wall = np.empty(repeats)
    cpu = np.empty(repeats)
    ks = np.zeros(batch, dtype=np.int64)
    for i in range(repeats):
        drafted = ks
        accepted = rng.binomial(drafted, 0.7)
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        ks = ctl.step(slots, drafted, accepted, 0.02)
        wall[i] = time.perf_counter_ns() - t0
        cpu[i] = time.thread_time_ns() - c0
    skip = repeats // 10  # warm-up: allocator, the cost model's first refits
    wall, cpu = wall[skip:] / 1e3, cpu[skip:] / 1e3
    return {
        "batch": batch,
        "speculating": speculating,
        "mean_k": float(np.mean(ks)),
        "median_us": float(np.median(wall)),
        "p99_us": float(np.percentile(wall, 99)),
        "cpu_median_us": float(np.median(cpu)),
        "cpu_p99_us": float(np.percentile(cpu, 99)),
        "errors": ctl.errors,
    }
