"""The two dashboards as data: panels, their queries and units (no Grafana, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# Relative to where the command runs (the repository root, for the committed copies): an
# installed package has no examples/ folder of its own.
DEFAULT_OUT = Path("examples") / "grafana"
DASHBOARD_FILES = {"overview": "adaptspec-overview.json", "class": "adaptspec-class.json"}
DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"

CLASS_ITL_NOTE = (
    "vLLM's latency histograms have no class label, so these are server-wide: "
    "vllm:inter_token_latency_seconds is the time between two outputs of a request (one per "
    "engine step, however many tokens it carried: with speculation it is the step interval, "
    "not the time per token), and vllm:request_time_per_output_token_seconds is each finished "
    "request's (end - first token) / (tokens - 1). The '$class time per token' line is an "
    "estimate: vLLM's mean inter-token latency divided by the class's tokens per step "
    "(1 + accepted drafts per request-step), i.e. what a request of the class waits per token."
)


# ------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class Query:
    """One PromQL target of a panel."""

    expr: str
    legend: str
    instant: bool = False
    heatmap: bool = False  # Grafana's "heatmap" format: cumulative le buckets -> per bucket


@dataclass(frozen=True)
class Panel:
    """A dashboard panel; ``key`` panels are the ones :func:`snapshot` renders."""

    title: str
    description: str
    queries: tuple[Query, ...]
    kind: str = "timeseries"  # timeseries | heatmap | bargauge | stat
    unit: str = "short"
    width: int = 12
    height: int = 8
    key: bool = False
    stack: bool = False
    min: float | None = None
    max: float | None = None
    dashed: tuple[str, ...] = ()  # legends drawn dashed (vLLM's series, estimates, predictions)


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    rows: tuple[tuple[str, tuple[Panel, ...]], ...]
    class_variable: bool = False
    tags: tuple[str, ...] = ("adaptspec", "vllm", "speculative-decoding")
    extra_links: tuple[str, ...] = field(default_factory=tuple)

    def panels(self) -> list[Panel]:
        return [p for _, panels in self.rows for p in panels]


def _r(metric: str, match: str = "", by: str = "", window: str = RATE) -> str:
    """``sum by (by) (rate(metric{match}[window]))`` (``sum (...)`` when by is empty)."""
    sel = f"{metric}{{{match}}}" if match else metric
    grp = f" by ({by})" if by else ""
    return f"sum{grp} (rate({sel}[{window}]))"


def _fill(expr: str, like: str) -> str:
    """``expr`` with 0 for groups that exist in ``like`` but not in ``expr`` (counters that
    were never incremented for a class, e.g. accepted drafts of a latency-critical class)."""
    return f"({expr} or 0 * {like})"


# --------------------------------------------------------------------------------- overview

STEPS = "adaptspec_steps_total"
DRAFT = "adaptspec_draft_tokens_total"
ACC = "adaptspec_accepted_tokens_total"
ACC_POS = "adaptspec_accepted_tokens_per_pos_total"
DRAFT_POS = "adaptspec_draft_tokens_per_pos_total"
K_BUCKET, K_SUM, K_COUNT = "adaptspec_chosen_k_bucket", "adaptspec_chosen_k_sum", \
    "adaptspec_chosen_k_count"
ESTIMATE = "adaptspec_acceptance_estimate"
ERRORS = "adaptspec_controller_errors_total"
STEP_MS = "adaptspec_step_time_ms"
V_DRAFTS = "vllm:spec_decode_num_drafts_total"
V_DRAFT_TOK = "vllm:spec_decode_num_draft_tokens_total"
V_ACC = "vllm:spec_decode_num_accepted_tokens_total"
V_ACC_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
V_ITL = "vllm:inter_token_latency_seconds_bucket"
V_ITL_SUM, V_ITL_COUNT = "vllm:inter_token_latency_seconds_sum", \
    "vllm:inter_token_latency_seconds_count"
V_TPOT_SUM, V_TPOT_COUNT = "vllm:request_time_per_output_token_seconds_sum", \
    "vllm:request_time_per_output_token_seconds_count"
V_RUNNING = "vllm:num_requests_running"
SPEC = 'decision="speculate"'
NOT_LC = 'decision!="latency_critical"'

VLLM_ACCEPTANCE = f"{_r(V_ACC)} / {_r(V_DRAFT_TOK)}"
VLLM_TOKENS_PER_STEP = f"1 + {_r(V_ACC)} / {_r(V_DRAFTS)}"


def _class_match(cls: bool) -> str:
    return 'class=~"$class"' if cls else ""


def overview() -> Dashboard:
    steps_by_class = _r(STEPS, by="class")
    acceptance = Panel(
        "Acceptance per class",
        "Share of verified draft tokens the target accepted, per class (solid), the controller's "
        "posterior estimate for draft position 0 (adaptspec_acceptance_estimate, dotted), and "
        "vLLM's own server-wide acceptance from vllm:spec_decode_* (dashed). Classes the "
        "controller never drafts for (latency-critical) have no line.",
        (
            Query(f"{_r(ACC, by='class')} / {_r(DRAFT, by='class')}", "{{class}}"),
            Query(f"max by (class) ({ESTIMATE})", "{{class}} estimate (pos 0)"),
            Query(VLLM_ACCEPTANCE, "vLLM (all requests)"),
        ),
        unit="percentunit", key=True, min=0, max=1,
        dashed=("vLLM (all requests)", "estimate"),
    )
    tokens_per_step = Panel(
        "Tokens per step",
        "Tokens a request gets per engine step it is in: 1 + accepted drafts per request-step, "
        "per class (plain and latency-critical steps count as 1). vLLM's mean acceptance length "
        "(1 + accepted / drafts, dashed) counts only steps that speculated.",
        (
            Query(f"1 + {_fill(_r(ACC, by='class'), steps_by_class)} / {steps_by_class}",
                  "{{class}}"),
            Query(VLLM_TOKENS_PER_STEP, "vLLM mean acceptance length"),
        ),
        key=True, min=1, dashed=("vLLM mean acceptance length",),
    )
    k_dist = Panel(
        "Chosen K distribution",
        "How often each K was chosen per request-step (all classes), from the "
        "adaptspec_chosen_k histogram: bucket le=0.5 is K = 0, le=1.5 is K = 1, and so on.",
        (Query(f"sum by (le) (rate({K_BUCKET}[{RATE}]))", "{{le}}", heatmap=True),),
        kind="heatmap", key=True,
    )
    mean_k = Panel(
        "Mean K per class",
        "Mean chosen K per request-step, per class (adaptspec_chosen_k_sum / _count), beside "
        "vLLM's draft tokens per draft (the K it actually verified, over speculating "
        "requests only).",
        (
            Query(f"{_r(K_SUM, by='class')} / {_r(K_COUNT, by='class')}", "{{class}}"),
            Query(f"{_r(V_DRAFT_TOK)} / {_r(V_DRAFTS)}", "vLLM draft tokens per draft"),
        ),
        min=0, dashed=("vLLM draft tokens per draft",),
    )
    decisions = Panel(
        "Decisions by type",
        "Per-request decisions per second, stacked: speculate (K > 0), plain (K = 0 because "
        "speculation would cost more than it saves), latency_critical (class never "
        "speculates), fallback (controller fault: the policy's fallback_k).",
        (Query(_r(STEPS, by="decision"), "{{decision}}"),),
        unit="ops", stack=True, key=True, min=0,
    )
    share = Panel(
        "Share of steps speculated",
        "Per class: request-steps with K > 0 over all request-steps of the class. 'all "
        "speculable' leaves latency-critical steps out of the denominator: it falling to 0 "
        "under load means the cost model turned speculation off (expected when the batch is "
        "compute-bound; see the alert SpeculationStoppedUnderLoad).",
        (
            Query(f"{_fill(_r(STEPS, SPEC, 'class'), steps_by_class)} / "
                  f"{steps_by_class}", "{{class}}"),
            Query(f"({_r(STEPS, SPEC)} or vector(0)) / "
                  f"{_r(STEPS, NOT_LC)}", "all speculable"),
        ),
        unit="percentunit", key=True, min=0, max=1, dashed=("all speculable",),
    )
    errors = Panel(
        "Controller errors",
        "Controller faults absorbed per interval (adaptspec_controller_errors_total); each "
        "one gave the affected step the policy's fallback_k. Should stay at 0.",
        (
            Query(f"sum (increase({ERRORS}[{RATE}]))", "errors"),
            Query(_r(STEPS, 'decision="fallback"'), "fallback decisions / s"),
        ),
        min=0,
    )
    errors_total = Panel(
        "Controller errors (range)",
        "Controller faults over the dashboard's time range.",
        (Query(f"sum (increase({ERRORS}[$__range]))", "errors", instant=True),),
        kind="stat", width=4,
    )
    step_time = Panel(
        "Step time: predicted vs measured",
        "The controller's cost model prediction for the step it chose (predicted, dashed) and "
        "the measured time of the last pure-decode step (measured). Gauges of the last step, "
        "sampled at each scrape; a lasting gap means the cost model needs learning "
        "(cost_model.learn) or a different preset.",
        (
            Query(f'max by (kind) ({STEP_MS}{{kind="measured"}})', "measured"),
            Query(f'max by (kind) ({STEP_MS}{{kind="predicted"}})', "predicted"),
        ),
        unit="ms", key=True, min=0, dashed=("predicted",), width=20,
    )
    vllm_raw = Panel(
        "vLLM spec decode throughput",
        "vLLM's own counters, for cross-checking ours: drafts, draft tokens and accepted "
        "tokens per second (all requests), and our draft / accepted tokens (all classes). "
        "They agree, except that steps whose controller call failed are missing from ours.",
        (
            Query(_r(V_DRAFTS), "vLLM drafts / s"),
            Query(_r(V_DRAFT_TOK), "vLLM draft tokens / s"),
            Query(_r(V_ACC), "vLLM accepted tokens / s"),
            Query(_r(DRAFT), "adaptspec draft tokens / s"),
            Query(_r(ACC), "adaptspec accepted tokens / s"),
        ),
        unit="ops", min=0, width=24,
        dashed=("vLLM drafts / s", "vLLM draft tokens / s", "vLLM accepted tokens / s"),
    )
    return Dashboard(
        uid="adaptspec-overview",
        title="adaptspec overview",
        description="Adaptive speculative decoding (adaptspec) beside vLLM's spec decode metrics.",
        rows=(
            ("Acceptance", (acceptance, tokens_per_step)),
            ("Draft length", (k_dist, mean_k)),
            ("Decisions", (decisions, share)),
            ("Cost and faults", (step_time, errors_total, errors, vllm_raw)),
        ),
    )


def class_dashboard() -> Dashboard:
    m = 'class="$class"'
    steps = _r(STEPS, m)
    per_pos = Panel(
        "Acceptance per draft position",
        "Conditional acceptance at draft position j for $class: accepted at j / drafted at j "
        "(a draft at j is verified only if all before it were accepted). vLLM's per-position "
        "series (dashed) is server-wide and divided by its number of drafts, so it is the "
        "unconditional rate of reaching and accepting position j.",
        (
            Query(f"{_fill(_r(ACC_POS, m, 'position'), _r(DRAFT_POS, m, 'position'))} / "
                  f"{_r(DRAFT_POS, m, 'position')}", "position {{position}}"),
            Query(f"{_r(V_ACC_POS, by='position')} / scalar({_r(V_DRAFTS)})",
                  "vLLM position {{position}}"),
        ),
        unit="percentunit", key=True, min=0, max=1, dashed=("vLLM position",),
    )
    per_pos_bar = Panel(
        "Acceptance per draft position (time range)",
        "The same ratio over the dashboard's time range.",
        (Query(f"sum by (position) (increase({ACC_POS}{{{m}}}[$__range])) / "
               f"sum by (position) (increase({DRAFT_POS}{{{m}}}[$__range]))",
               "{{position}}", instant=True),),
        kind="bargauge", unit="percentunit", min=0, max=1,
    )
    k_time = Panel(
        "K over time",
        "Mean chosen K per request-step of $class (adaptspec_chosen_k_sum / _count, K = 0 "
        "steps included) beside vLLM's draft tokens per draft (all classes, speculating "
        "requests only).",
        (
            Query(f"{_r(K_SUM, m)} / {_r(K_COUNT, m)}", "mean K"),
            Query(f"{_r(V_DRAFT_TOK)} / {_r(V_DRAFTS)}", "vLLM draft tokens per draft"),
        ),
        key=True, min=0, dashed=("vLLM",),
    )
    k_dist = Panel(
        "K distribution",
        "How often each K was chosen for $class (bucket le=0.5 is K = 0, le=1.5 is K = 1, ...; "
        "the +Inf bucket is K = k_max).",
        (Query(f"sum by (le) (rate({K_BUCKET}{{{m}}}[{RATE}]))", "{{le}}", heatmap=True),),
        kind="heatmap", key=True,
    )
    acc_time = Panel(
        "Acceptance and estimate",
        "Measured acceptance of $class (accepted / drafted) beside the controller's posterior "
        "mean for position 0.",
        (
            Query(f"{_r(ACC, m)} / {_r(DRAFT, m)}", "measured"),
            Query(f"max by (class) ({ESTIMATE}{{{m}}})", "estimate (pos 0)"),
        ),
        unit="percentunit", min=0, max=1, dashed=("estimate (pos 0)",),
    )
    decisions = Panel(
        "Decisions",
        "Per-request decisions of $class per second, stacked.",
        (Query(_r(STEPS, m, "decision"), "{{decision}}"),),
        unit="ops", stack=True, min=0,
    )
    tokens = Panel(
        "Tokens per step",
        "1 + accepted drafts per request-step of $class.",
        (Query(f"1 + {_fill(_r(ACC, m), steps)} / {steps}", "tokens per step"),),
        min=1,
    )
    proposer_share = Panel(
        "Proposer share",
        "Which proposer the controller chose to draft $class's speculating request-steps, as a "
        "share of them (one line per proposer; a server with one proposer shows one line at "
        "100%).",
        (Query(f"{_r(STEPS, f'{m},{SPEC}', 'proposer')} / scalar({_r(STEPS, f'{m},{SPEC}')})",
               "{{proposer}}"),),
        unit="percentunit", key=True, min=0, max=1,
    )
    proposer_acc = Panel(
        "Acceptance per proposer",
        "Share of $class's verified draft tokens accepted, per proposer that drafted them.",
        (Query(f"{_r(ACC, m, 'proposer')} / {_r(DRAFT, m, 'proposer')}", "{{proposer}}"),),
        unit="percentunit", key=True, min=0, max=1,
    )
    itl = Panel(
        "Inter-token latency",
        CLASS_ITL_NOTE,
        (
            Query(f"histogram_quantile(0.5, {_r(V_ITL, by='le')})", "vLLM p50 (all classes)"),
            Query(f"histogram_quantile(0.99, {_r(V_ITL, by='le')})", "vLLM p99 (all classes)"),
            Query(f"{_r(V_TPOT_SUM)} / {_r(V_TPOT_COUNT)}",
                  "vLLM time per output token (all classes)"),
            Query(f"({_r(V_ITL_SUM)} / {_r(V_ITL_COUNT)}) / scalar(1 + "
                  f"{_fill(_r(ACC, m), steps)} / {steps})", "$class time per token (estimate)"),
        ),
        unit="s", key=True, min=0, width=12, dashed=("estimate",),
    )
    return Dashboard(
        uid="adaptspec-class",
        title="adaptspec class",
        description="One adaptspec request class: per-position acceptance, K, latency.",
        rows=(
            ("Acceptance", (per_pos, per_pos_bar)),
            ("Draft length", (k_time, k_dist)),
            ("Throughput and latency", (acc_time, tokens, decisions, itl)),
            ("Proposers", (proposer_share, proposer_acc)),
        ),
        class_variable=True,
    )


def dashboards() -> dict[str, Dashboard]:
    return {"overview": overview(), "class": class_dashboard()}
