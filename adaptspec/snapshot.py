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
    records: list[tuple[int, str, np.ndarray, np.ndarray]] = []
    for prop, name, rec in ((p, n, r) for p, cs in by_proposer.items() for n, r in cs.items()):
        if not isinstance(name, str) or prop not in ctl.proposers:
            continue
        succ, fail = _evidence(f"class {name!r}", rec)
        records.append((ctl.proposers.index(prop), name, succ[: est.k_max], fail[: est.k_max]))
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
    restored: set[int] = set()
    for prop, name, succ, fail in records:
        idx = ctl.restore_class(name)
        if idx is None:
            continue  # a class the policy no longer names
        restored.add(idx)
        row, n = prop * ctl.n_cls + idx, len(succ)
        est.succ[row, :n] = succ
        est.fail[row, :n] = fail
    if coef_arr is not None and ctl.cost.learn:
        ctl.cost.coef = coef_arr
    return len(restored)


def _evidence(what: str, rec: Any) -> tuple[np.ndarray, np.ndarray]:
    """A record's succ and fail lists, checked: equal-length 1-d, finite, non-negative."""
    try:
        succ = np.asarray(rec["succ"], dtype=float)
        fail = np.asarray(rec["fail"], dtype=float)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise SnapshotError(f"{what}: {e}") from None
    if succ.ndim != 1 or fail.ndim != 1 or succ.shape != fail.shape:
        raise SnapshotError(f"{what}: succ/fail must be equal-length lists")
    if not (np.isfinite(succ).all() and np.isfinite(fail).all()):
        raise SnapshotError(f"{what}: non-finite evidence")
    if (succ < 0).any() or (fail < 0).any():
        raise SnapshotError(f"{what}: negative evidence")
    return succ, fail


def save(ctl: Controller, path: str | Path) -> None:
    """Write the snapshot atomically (temp file, fsync, rename), readable by the owner only."""
    write(state_dict(ctl), path)


def write(state: dict[str, Any], path: str | Path) -> None:
    """Write a state dict as `save` does."""
    path = Path(path)
    data = json.dumps(state, separators=(",", ":")).encode()
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


def engine_path(path: str | None, engine: int) -> str | None:
    """The state file of engine `engine` (its data-parallel index): engine 0 keeps the name as
    given, engine i > 0 writes `STEM.engine{i}SUFFIX` beside it, so engines never write one
    file. (vLLM gives a non-MoE data-parallel engine core no way to know how many engines
    there are: it runs as an engine of one, knowing only its index.) A one-engine server that
    is restarted with more engines keeps its learned state in engine 0."""
    if not path or engine <= 0:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.engine{engine}{p.suffix}"))


def merge(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One snapshot from several engines' (data-parallel ranks, replicas): the evidence of each
    (proposer, class, position) is summed (each engine saw other requests; the sum is what
    one engine would hold had it seen them all, decayed as each engine decayed its own), steps
    add up, and the step-time coefficients are the mean weighted by steps (one hardware). A
    file without "proposers" (older) counts as the evidence of the first proposer named."""
    if not states:
        raise SnapshotError("nothing to merge")
    for st in states:
        if not isinstance(st, dict) or st.get("format") != FORMAT or st.get("version") != VERSION:
            raise SnapshotError("not an adaptspec state snapshot of version "
                                f"{VERSION}")
    first = next((next(iter(st["proposers"])) for st in states if st.get("proposers")),
                 "ngram")
    evidence: dict[str, dict[str, list[np.ndarray]]] = {}
    for st in states:
        by_prop = st.get("proposers") or {first: st.get("classes", {})}
        for prop, classes in by_prop.items():
            for name, rec in classes.items():
                sf = _evidence(f"{prop}/{name}", rec)
                acc = evidence.setdefault(prop, {}).setdefault(name, [np.zeros(0)] * 2)
                for i in range(2):
                    n = max(len(acc[i]), len(sf[i]))
                    acc[i] = np.pad(acc[i], (0, n - len(acc[i]))) + np.pad(sf[i],
                                                                           (0, n - len(sf[i])))
    steps = [max(int(st.get("steps", 0) or 0), 0) for st in states]
    coefs = [(np.asarray(st["cost_coef_ms"], dtype=float), w) for st, w in zip(states, steps,
                                                                             strict=True)
             if st.get("cost_coef_ms") is not None]
    out: dict[str, Any] = {
        "format": FORMAT, "version": VERSION,
        "k_max": max(int(st.get("k_max", 0) or 0) for st in states),
        "steps": sum(steps),
        "proposers": {p: {n: {"succ": s.tolist(), "fail": f.tolist()} for n, (s, f) in cs.items()}
                      for p, cs in evidence.items()},
    }
    out["classes"] = out["proposers"].get(first, {})
    if coefs and len({c.shape for c, _ in coefs}) == 1:
        w = np.array([max(w, 1) for _, w in coefs], dtype=float)
        out["cost_coef_ms"] = (np.stack([c for c, _ in coefs]) * w[:, None]).sum(0) / w.sum()
        out["cost_coef_ms"] = out["cost_coef_ms"].tolist()
    return out


def read(path: str | Path) -> dict[str, Any]:
    """A snapshot file's state dict (not checked against a controller)."""
    try:
        return json.loads(Path(path).read_bytes())
    except (ValueError, RecursionError) as e:
        raise SnapshotError(f"{path}: not valid JSON ({str(e)[:200]})") from None


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
