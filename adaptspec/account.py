"""Where an engine's time goes: every second of it in one category, from the scheduler's clock.

adaptspec's payoff series (`adaptspec_payoff_saved_ms_total`) compare the steps' own timings and
credit speculation with far more than the wall clock shows (issue 34): time outside the measured
steps (scheduling, output processing, steps that carry a prefill, the first use of a token
count) never enters them. This account partitions the engine's time instead: from the first
`step_started` on, each interval between two events of the scheduler goes to exactly one
category, so the categories always sum to the time covered, and a plain server and an adaptspec
server can be compared category by category over the same stream.

Engine-agnostic: the scheduler passes timestamps and a few numbers of each step (`step_shape`
reads them off anything shaped like vLLM's SchedulerOutput).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter

log = logging.getLogger(__name__)

# decode_plain: no prefill, no draft verified. decode_spec: no prefill, >= 1 draft verified.
# prefill: some request scheduled more than 1 + its drafts tokens. first_shape: a decode step
# whose token count was new to the engine (a first use can pay one-off costs: kernel selection,
# graph capture, compilation), counted here instead of its decode category. between: from a step's
# end to the next step's start while requests are unfinished (scheduling, output processing,
# draft bookkeeping), and steps that scheduled no token (no model ran). idle: that gap when no
# request was unfinished (the engine waits for work: not serving time).
CATEGORIES = ("decode_plain", "decode_spec", "prefill", "first_shape", "between", "idle")
DECODE = ("decode_plain", "decode_spec")
EXACT_BATCH_MAX = 64  # batch sizes above this share power-of-two buckets
MAX_SHAPES = 1 << 16  # token counts remembered (the engine's token budget bounds them anyway)


def _num(x: Any, kind: type = int) -> Any:
    """x as an int (or float), None where it is not a finite number: odd input never raises."""
    try:
        v = kind(x)
    except (TypeError, ValueError, OverflowError):
        return None
    return v if math.isfinite(v) else None


def batch_bucket(batch: int) -> int:
    """`batch` itself up to 64, else the next power of two: keeps the per-batch keys bounded."""
    batch = max(int(batch), 0)
    return batch if batch <= EXACT_BATCH_MAX else 1 << (batch - 1).bit_length()


def verified_drafts(slots: Sequence[int], invalid: int = 0) -> int:
    """A request's draft tokens verified in a step, as vLLM counts them (its SpecDecodingStats):
    the slots scheduled less the `invalid` ones structured output rejected
    (`SchedulerOutput.num_invalid_spec_tokens`). A slot's value says nothing: under async
    scheduling every slot is a -1 placeholder for a draft the worker holds."""
    return max(len(slots) - int(invalid), 0)


def carries_prefill(n_tokens: int, slots: Sequence[int]) -> bool:
    """Whether a request scheduled `n_tokens` beside `slots` draft slots is prefilling: a
    decode schedules 1 + its drafts."""
    return n_tokens > 1 + len(slots)


def step_shape(scheduler_output: Any) -> dict[str, Any]:
    """A step's batch size, draft tokens verified, whether it carried a prefill chunk and its
    total token count, from a SchedulerOutput-like object (the keyword arguments of
    `EngineAccount.step_ended`)."""
    scheduled: Mapping[str, int] = scheduler_output.num_scheduled_tokens
    spec: Mapping[str, Sequence[int]] = scheduler_output.scheduled_spec_decode_tokens or {}
    invalid: Mapping[str, int] = getattr(scheduler_output, "num_invalid_spec_tokens", None) or {}
    drafted, prefill = 0, False
    for req_id, n_tokens in scheduled.items():
        slots = spec.get(req_id) or ()
        drafted += verified_drafts(slots, invalid.get(req_id, 0))
        prefill = prefill or carries_prefill(n_tokens, slots)
    return {"batch": len(scheduled), "drafted": drafted, "prefill": prefill,
            "num_tokens": int(scheduler_output.total_num_scheduled_tokens)}


class EngineAccount:
    """The engine's time in CATEGORIES, from two events per step.

    `seconds` and `steps` per category (for between and idle, `steps` counts intervals);
    decode steps also per (category, batch bucket) in `batch_seconds`, `batch_steps` and
    `batch_drafts` (draft tokens verified). `sink(category, seconds)` is told each interval as
    it closes, and `decode_sink(category, batch bucket, seconds, drafts)` each decode step (the
    Prometheus counters). Nothing before the first `step_started` is covered; after it, every
    interval up to the last event is in exactly one category.
    """

    def __init__(self, sink: Callable[[str, float], None] | None = None,
                 decode_sink: Callable[[str, int, float, int], None] | None = None) -> None:
        self.sink = sink
        self.decode_sink = decode_sink
        self.seconds: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
        self.steps: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.batch_seconds: dict[tuple[str, int], float] = {}
        self.batch_steps: dict[tuple[str, int], int] = {}
        self.batch_drafts: dict[tuple[str, int], int] = {}
        self.opened: float | None = None  # the first step_started
        self.mark: float | None = None  # everything up to here is accounted
        self._in_step = False
        self._gap = "idle"  # the category of the time after mark while no step runs
        self._shapes: set[int] = set()

    def _close(self, now: float, category: str) -> float:
        # The clock never runs back here: a time before mark adds 0 and leaves mark, so the sum
        # stays equal to mark - opened.
        assert self.mark is not None
        dt = max(now - self.mark, 0.0)
        self.mark = max(now, self.mark)
        self.seconds[category] += dt
        self.steps[category] += 1
        self._tell("sink", category, dt)
        return dt

    def _tell(self, which: str, *args: Any) -> None:
        """Call a sink (attribute `which`); one that fails is dropped and the account goes on."""
        sink = getattr(self, which)
        if sink is None:
            return
        try:
            sink(*args)
        except Exception:
            log.exception("adaptspec: engine account sink failed; dropped")
            setattr(self, which, None)

    def step_started(self, now: float) -> None:
        """At the start of schedule(): the gap since the last step closes (between or idle)."""
        now = _num(now, float)
        if now is None:
            return
        if self.mark is None:
            self.opened = self.mark = now
        else:
            # a step that never ended (its update never came): its time is overhead
            self._close(now, "between" if self._in_step else self._gap)
        self._in_step = True

    def step_ended(self, now: float, *, batch: int, drafted: int, prefill: bool,
                   num_tokens: int, unfinished: bool = True) -> None:
        """At the end of update_from_output(): the step closes in its category. `unfinished`:
        whether requests remain unfinished, which makes the gap until the next step `between`
        (else `idle`). Ignored without a step_started before it."""
        now = _num(now, float)
        if not self._in_step or now is None:
            return
        batch, drafted, num_tokens = _num(batch) or 0, max(_num(drafted) or 0, 0), _num(num_tokens)
        if not num_tokens or num_tokens <= 0 or batch <= 0:
            category = "between"  # nothing scheduled, no model ran
        elif prefill:
            # (before first_shape: prompts of every length make most prefill steps new shapes,
            # and a prefill step's time is the prompt's, not a first use's)
            category = "prefill"
        elif num_tokens not in self._shapes:
            category = "first_shape"
            if len(self._shapes) < MAX_SHAPES:
                self._shapes.add(num_tokens)
        else:
            category = "decode_spec" if drafted else "decode_plain"
        dt = self._close(now, category)
        if category in DECODE:
            key = (category, batch_bucket(batch))
            self.batch_seconds[key] = self.batch_seconds.get(key, 0.0) + dt
            self.batch_steps[key] = self.batch_steps.get(key, 0) + 1
            self.batch_drafts[key] = self.batch_drafts.get(key, 0) + drafted
            self._tell("decode_sink", category, key[1], dt, drafted)
        self._in_step = False
        self._gap = "between" if unfinished else "idle"

    def total(self) -> float:
        """Seconds accounted: the sum of the categories, = span() up to rounding."""
        return math.fsum(self.seconds.values())

    def span(self) -> float:
        """Seconds from the first step_started to the last event."""
        return 0.0 if self.mark is None or self.opened is None else self.mark - self.opened

    def snapshot(self) -> dict[str, Any]:
        """The account as JSON-ready data; `decode` maps category -> batch bucket -> counts."""
        decode: dict[str, dict[str, dict[str, float]]] = {c: {} for c in DECODE}
        for (cat, batch), s in sorted(self.batch_seconds.items()):
            decode[cat][str(batch)] = {"seconds": s, "steps": self.batch_steps[(cat, batch)],
                                       "drafts": self.batch_drafts[(cat, batch)]}
        return {"seconds": dict(self.seconds), "steps": dict(self.steps), "decode": decode,
                "total_s": self.total(), "span_s": self.span(),
                "in_step": self._in_step, "gap": None if self._in_step else self._gap}


class AccountMetrics:
    """`adaptspec_engine_seconds_total{engine,category}` and
    `adaptspec_engine_steps_total{engine,category}`: an EngineAccount's categories as Prometheus
    counters (pass `add` as its sink); its decode steps by batch size (bucket, see
    batch_bucket) as `adaptspec_engine_decode_{seconds,steps,drafts}_total{engine,category,
    batch}` (pass `add_decode` as its decode_sink). `engine` is vLLM's data-parallel index
    label, as on the other adaptspec series; every category's series exists from the start,
    at 0."""

    def __init__(self, engine: int | str = 0, registry: CollectorRegistry | None = None) -> None:
        self.engine = str(engine)
        self._registry = registry if registry is not None else REGISTRY
        self._families: list[Counter] = []
        try:
            seconds = self._family("adaptspec_engine_seconds", "Engine time by category: decode "
                                   "steps (plain, spec), prefill steps, first uses of a token "
                                   "count, between steps, idle; the categories partition it")
            steps = self._family("adaptspec_engine_steps", "Engine steps by category (for "
                                 "between and idle: the gaps)")
            self._decode = {
                what: self._family(f"adaptspec_engine_decode_{what}", doc, ["batch"])
                for what, doc in (
                    ("seconds", "Decode-step time by category and batch size (bucket)"),
                    ("steps", "Decode steps by category and batch size (bucket)"),
                    ("drafts", "Draft tokens verified in decode steps by category and batch "
                               "size (bucket)"))}
        except Exception:
            self.unregister()
            raise
        self._seconds = {c: seconds.labels(self.engine, c) for c in CATEGORIES}
        self._steps = {c: steps.labels(self.engine, c) for c in CATEGORIES}

    def _family(self, name: str, doc: str, extra: Sequence[str] = ()) -> Counter:
        metric = Counter(name, doc, ["engine", "category", *extra], registry=self._registry)
        self._families.append(metric)
        return metric

    def add(self, category: str, seconds: float) -> None:
        """One closed interval of `category`."""
        self._seconds[category].inc(max(seconds, 0.0))
        self._steps[category].inc()

    def add_decode(self, category: str, batch: int, seconds: float, drafts: int) -> None:
        """One decode step of `category` at batch size (bucket) `batch`."""
        b = str(batch)
        self._decode["seconds"].labels(self.engine, category, b).inc(max(seconds, 0.0))
        self._decode["steps"].labels(self.engine, category, b).inc()
        self._decode["drafts"].labels(self.engine, category, b).inc(max(drafts, 0))

    def unregister(self) -> None:
        """Take these series out of their registry, so another engine may take the names."""
        for metric in self._families:
            try:
                self._registry.unregister(metric)
            except KeyError:  # already out
                pass
