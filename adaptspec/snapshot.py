"""Learned controller state on disk: written atomically, read defensively.

A snapshot holds what took traffic to learn (per-class acceptance evidence and the step-time
curve), keyed by class name so it survives policy edits that add or reorder classes.
"proposers" holds the evidence of every proposer the server ran, keyed by proposer name: a
server restores the proposers it runs and ignores the others. "classes" repeats the first
proposer's; a file without "proposers" (written before proposers could be mixed) is read as
the evidence of the server's first proposer. It is
plain JSON: nothing in it is executed, and a corrupt or foreign file is refused with a warning
rather than half-applied.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from adaptspec.controller import Controller

log = logging.getLogger(__name__)

FORMAT = "adaptspec-state"
VERSION = 1


class SnapshotError(ValueError):
    """A snapshot file that cannot be used."""


def state_dict(ctl: Controller) -> dict[str, Any]:
    est = ctl.estimator

    def evidence(p: int) -> dict[str, dict[str, list[float]]]:
        return {name: {"succ": est.succ[r].tolist(), "fail": est.fail[r].tolist()}
                for name, r in ((n, p * ctl.n_cls + i) for i, n in enumerate(ctl.class_names))}

    out = {
        "format": FORMAT,
        "version": VERSION,
        "k_max": est.k_max,
        "steps": ctl.steps,
        "classes": evidence(0),
        "cost_coef_ms": ctl.cost.coef.tolist(),
    }
    out["proposers"] = {name: evidence(p) for p, name in enumerate(ctl.proposers)}
    return out


def load_state_dict(ctl: Controller, state: dict[str, Any]) -> int:
    """Apply a snapshot to a controller; returns how many classes were restored.

    Classes the policy no longer names are skipped; evidence for positions beyond the current
    k_max is dropped. Validation happens before anything is written, so a bad file changes
    nothing.
    """
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise SnapshotError("not an adaptspec state snapshot")
    if state.get("version") != VERSION:
        raise SnapshotError(f"snapshot version {state.get('version')!r}, expected {VERSION}")
    classes = state.get("classes")
    if not isinstance(classes, dict):
        raise SnapshotError("snapshot has no 'classes' mapping")
    est = ctl.estimator
    by_proposer = state.get("proposers")
    if by_proposer is None:
        by_proposer = {ctl.proposers[0]: classes}
    elif not isinstance(by_proposer, dict) or not all(isinstance(v, dict)
                                                       for v in by_proposer.values()):
        raise SnapshotError("snapshot 'proposers' must map proposer names to classes")
    updates: list[tuple[int, np.ndarray, np.ndarray]] = []
    restored: set[int] = set()
    for prop, name, rec in ((p, n, r) for p, cs in by_proposer.items() for n, r in cs.items()):
        idx = ctl._class_index.get(name) if isinstance(name, str) else None
        if idx is None or prop not in ctl.proposers:
            continue
        restored.add(idx)
        idx += ctl.proposers.index(prop) * ctl.n_cls
        try:
            succ = np.asarray(rec["succ"], dtype=float)
            fail = np.asarray(rec["fail"], dtype=float)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise SnapshotError(f"class {name!r}: {e}") from None
        if succ.ndim != 1 or fail.ndim != 1:  # a bare number cannot be sliced below
            raise SnapshotError(f"class {name!r}: succ/fail must be equal-length lists")
        succ, fail = succ[: est.k_max], fail[: est.k_max]
        if succ.shape != fail.shape:
            raise SnapshotError(f"class {name!r}: succ/fail must be equal-length lists")
        if not (np.isfinite(succ).all() and np.isfinite(fail).all()):
            raise SnapshotError(f"class {name!r}: non-finite evidence")
        if (succ < 0).any() or (fail < 0).any():
            raise SnapshotError(f"class {name!r}: negative evidence")
        updates.append((idx, succ, fail))
    coef = state.get("cost_coef_ms")
    coef_arr = None
    if coef is not None:
        try:
            coef_arr = np.asarray(coef, dtype=float)
        except (TypeError, ValueError, OverflowError) as e:
            raise SnapshotError(f"cost_coef_ms: {e}") from None
        if coef_arr.shape == (6,) and ctl.cost.coef.shape == (7,):
            # Written before the per-request-and-pass term (B * maxK): that model is this one
            # with its coefficient at 0.
            coef_arr = np.append(coef_arr, 0.0)
        if coef_arr.shape != ctl.cost.coef.shape or not np.isfinite(coef_arr).all() \
                or (coef_arr < 0).any():
            raise SnapshotError("cost_coef_ms does not fit this cost model")
    for idx, succ, fail in updates:
        n = len(succ)
        est.succ[idx, :n] = succ
        est.fail[idx, :n] = fail
    if coef_arr is not None and ctl.cost.learn:
        ctl.cost.coef = coef_arr
    return len(restored)


def save(ctl: Controller, path: str | Path) -> None:
    """Write the snapshot atomically (temp file, fsync, rename), readable by the owner only."""
    path = Path(path)
    data = json.dumps(state_dict(ctl), separators=(",", ":")).encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _remove_stale_temps(path)


# A writer killed between creating its temp file and renaming it leaves the temp file behind
# (never read: the snapshot itself is always complete). Temp files this old are such leftovers,
# not a concurrent write in progress, and are removed after the next successful save.
STALE_TEMP_S = 600.0


def _remove_stale_temps(path: Path) -> None:
    cutoff = time.time() - STALE_TEMP_S
    try:
        for p in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
            try:
                if p.stat().st_mtime < cutoff:
                    p.unlink()
            except OSError:
                pass
    except OSError:
        pass


def load(ctl: Controller, path: str | Path) -> int:
    """Read a snapshot into the controller. A missing file is not an error (returns 0)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return 0
    try:
        state = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, huge ints, deep nesting
        raise SnapshotError(f"{path}: not valid JSON ({str(e)[:200]})") from None
    try:
        return load_state_dict(ctl, state)
    except SnapshotError as e:
        raise SnapshotError(f"{path}: {e}") from None
