"""Helpers for the reliability tests: engines and servers in subprocesses, load, statistics.

The quick version of every test runs by default; the long one needs ADAPTSPEC_LONG=1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from adaptspec.serve import wait_until_up

HERE = Path(__file__).resolve().parent
LONG = os.environ.get("ADAPTSPEC_LONG", "") not in ("", "0")
long_only = pytest.mark.skipif(not LONG, reason="long version: set ADAPTSPEC_LONG=1")

# Quick (CI) and long (ADAPTSPEC_LONG=1) sizes.
N_SAMPLES = 10_000 if LONG else 2_000  # seeded temperature-1.0 requests per configuration
LOAD_SECONDS = 300 if LONG else 45
GREEDY_TOKENS = 64  # reference length; load requests ask for a prefix of it
CLIENTS = 32
FAULT_SPEC = "raise_every=7,delay_ms=50,metrics_raise_every=5"
LOAD_POLICY_EXTRA = {"dynamic_classes": True, "max_classes": 8, "max_requests": 256,
                     "snapshot_interval_s": 2}
# Long version only: distinct greedy prompts through the load server (besides the quick set),
# injected controller faults in the load server (every 3rd step raises: over 1,000 in 5 min;
# every 2nd left the controller nothing to learn from: each step it decided for raised),
# and distinct class labels sent in a flood of one-token requests.
LONG_EXTRA_PROMPTS = 500
LONG_LOAD_FAULT = "raise_every=3"
LONG_CLASS_LABELS = 10_000


# ------------------------------------------------------------------------------ engines


def metric_sum(metrics: dict[str, dict], name: str, **labels: str) -> float:
    return sum(v for k, v in metrics.get(name, {}).items()
               if all(dict(k).get(a) == b for a, b in labels.items()))


def class_labels(metrics: dict[str, dict]) -> set[str]:
    return {dict(k)["class"] for name, series in metrics.items() if name.startswith("adaptspec_")
            for k in series if "class" in dict(k)}


# ------------------------------------------------------------------------------ server


def tree_rss(pid: int) -> int:
    """Resident memory (bytes) of a process and all its descendants."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


class Server:
    """`adaptspec serve` (or any server command) on loopback, with its log in a file."""

    def __init__(self, cmd: Sequence[str], log_path: Path, env: dict[str, str], port: int
                 ) -> None:
        self.cmd, self.env, self.port = list(cmd), env, port
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        self.t0 = time.monotonic()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 300) -> float:
        """Seconds from the start until the server answered /health."""
        wait_until_up(self.base + "/health", self.proc, self.log_path, timeout)
        return time.monotonic() - self.t0

    def metrics(self) -> dict[str, dict]:
        from adaptspec.tools.promtext import parse_metrics

        return parse_metrics(urllib.request.urlopen(self.base + "/metrics", timeout=30)
                             .read().decode())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 90) -> int:
        """Signal the server; returns its exit code (killing the whole group on a timeout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                self._log.close()
                raise AssertionError(f"server did not stop within {timeout} s") from None
        self._log.close()
        return self.proc.returncode

    def kill_group(self) -> None:
        """Last resort (fixture teardown): nothing of this server may outlive the tests."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        if not self._log.closed:
            self._log.close()


# The streaming client is adaptspec's own (the benchmark uses it too).
from adaptspec.tools.bench.client import StreamResult, stream_completion  # noqa: E402,F401

# ------------------------------------------------------------------------------ statistics


def chi2_two_sample(a: Sequence[Any], b: Sequence[Any], min_expected: float = 5.0
                    ) -> tuple[float, int]:
    """Chi-square test that two samples of categories come from one distribution.

    Categories whose expected count in either sample would fall below `min_expected` are
    pooled into one 'other' cell (and that cell too is dropped if it stays too small).
    Returns (p-value, degrees of freedom).
    """
    import numpy as np
    from scipy.stats import chi2_contingency

    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    frac = min(na, nb) / (na + nb)
    keep, other_a, other_b = [], 0, 0
    for cat in sorted(set(ca) | set(cb), key=lambda c: -(ca[c] + cb[c])):
        if (ca[cat] + cb[cat]) * frac >= min_expected:
            keep.append((ca[cat], cb[cat]))
        else:
            other_a += ca[cat]
            other_b += cb[cat]
    if (other_a + other_b) * frac >= min_expected:
        keep.append((other_a, other_b))
    table = np.array(keep, dtype=float).T
    if table.shape[1] < 2:
        return 1.0, 0
    res = chi2_contingency(table, correction=False)
    return float(res.pvalue), int(res.dof)
