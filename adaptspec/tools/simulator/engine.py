"""One simulated engine: its step time, the K choosers compared, and one closed-loop run."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from adaptspec.controller import Controller
from adaptspec.plan import StepFeedback
from adaptspec.policy import CostModel, Policy
from adaptspec.tools.simulator.stream import Proposers, Stream

# ------------------------------------------------------------------------------ step time


def engine_cost_model(policy: Policy, preset: str | None) -> CostModel:
    """The engine's true step-time curve: a named preset (adaptspec/policy.py, COST_PRESETS,
    where the sources are given) or, with none named, the policy's own cost model."""
    return policy.cost_model if preset is None else CostModel(preset=preset)


def controller_policy(policy: Policy, preset: str | None, prior: str) -> Policy:
    """The policy the controller runs. prior="engine": its cost prior is the engine's preset
    (a deployment sets cost_model.preset to its hardware; the learning and probing settings
    are the policy's), so the controller starts from the nominal curve and learns from noisy
    measurements. prior="policy": the policy as written, e.g. a CPU prior on a GPU engine."""
    if prior == "policy" or preset is None or preset == policy.cost_model.preset:
        return policy
    cm = policy.cost_model
    cost = CostModel(preset=preset, learn=cm.learn, forgetting=cm.forgetting,
                     prior_weight=cm.prior_weight, probe_every=cm.probe_every,
                     probe_margin=cm.probe_margin)
    return policy.model_copy(update={"cost_model": cost})


def step_ms(cfg: CostModel, batch: int, spec: np.ndarray | int,
            max_k: np.ndarray | int) -> np.ndarray:
    """True (noise-free) step time in ms: the formula documented on CostModel. Written out here
    rather than borrowed from the learner, so that a learner bug cannot hide in the truth."""
    s = np.asarray(spec, dtype=float)
    m = np.asarray(max_k, dtype=float)
    return (cfg.base_ms + cfg.per_request_ms * batch + cfg.per_draft_token_ms * s
            + cfg.per_draft_position_ms * m + cfg.spec_overhead_ms * (s > 0)
            + cfg.over_knee_ms * np.maximum(0.0, batch + s - cfg.knee_tokens)
            + cfg.per_request_pass_ms * batch * m)


# ------------------------------------------------------------------------------ policies


class Chooser(Protocol):
    """How a simulated policy picks K. `choose` sees the batch (stream indices), the last step's
    drafted/accepted counts per batch position (0 for new arrivals) and its measured time."""

    def admit(self, positions: np.ndarray, reqs: np.ndarray) -> None: ...

    def retire(self, reqs: np.ndarray) -> None: ...

    def choose(self, reqs: np.ndarray, drafted: np.ndarray, accepted: np.ndarray,
               last_ms: float | None) -> np.ndarray: ...


class FixedK:
    """K by class, fixed. With `limit_slack` set, a step carrying a latency-critical request
    drops every draft if the plan's true step time would exceed plain decoding's by more than
    the slack: the policy's latency rule, applied with perfect knowledge of the step time."""

    def __init__(self, stream: Stream, k_by_class: np.ndarray, critical: np.ndarray,
                 cost: CostModel, concurrency: int, limit_slack: float | None = None) -> None:
        self.k_of_req = np.asarray(k_by_class, dtype=np.int64)[stream.cls]
        self.critical_req = critical[stream.cls]
        self.cost, self.concurrency, self.slack = cost, concurrency, limit_slack
        self.limit = float(step_ms(cost, concurrency, 0, 0)) * (1.0 + (limit_slack or 0.0))

    def admit(self, positions: np.ndarray, reqs: np.ndarray) -> None:
        pass

    def retire(self, reqs: np.ndarray) -> None:
        pass

    def choose(self, reqs: np.ndarray, drafted: np.ndarray, accepted: np.ndarray,
               last_ms: float | None) -> np.ndarray:
        ks = self.k_of_req[reqs]
        if self.slack is not None and self.critical_req[reqs].any():
            t = float(step_ms(self.cost, self.concurrency, int(ks.sum()), int(ks.max())))
            if t > self.limit:
                return np.zeros_like(ks)
        return ks


class Adaptive:
    """The adaptspec controller, driven the way an engine drives it. With the stream's
    `proposers` it is the hybrid: it also chooses who drafts (`chosen`, per batch position,
    read by `simulate`), learns per proposer from what each drafted, and is told each step what
    a model proposer's passes cost, as the plugin's worker tells it."""

    def __init__(self, policy: Policy, stream: Stream, concurrency: int, seed: int,
                 lag: int | None = None) -> None:
        names = stream.proposers.names if stream.proposers is not None else ("ngram",)
        self.ctl = Controller(policy, seed=seed, proposers=names)
        self.names = stream.names
        self.cls = stream.cls
        self.slots = np.zeros(concurrency, dtype=np.int64)
        self.chosen: np.ndarray | None = (None if stream.proposers is None
                                          else np.zeros(concurrency, dtype=np.int64))
        # lag (not None): requests go the plugin's way, by id (admitted, planned by the
        # new-request rule until their first feedback arrives), and each step's feedback
        # reaches the controller `lag` steps after the next decision (async scheduling: the
        # scheduler deciding step N has seen up to N - 2, lag 1; see lagged_choice).
        if lag is not None and self.chosen is not None:
            raise ValueError("lagged feedback is simulated for one proposer only")
        self.lag = lag
        self.pending: deque[tuple[list[str], np.ndarray, np.ndarray, float | None]] = deque()
        self.live: set[str] = set()

    def admit(self, positions: np.ndarray, reqs: np.ndarray) -> None:
        for p, r in zip(positions.tolist(), reqs.tolist(), strict=True):
            if self.lag is not None:
                self.ctl.admit(f"r{r}", self.names[self.cls[r]])
                self.live.add(f"r{r}")
            else:
                self.slots[p] = self.ctl.add_request(f"r{r}", self.names[self.cls[r]])

    def retire(self, reqs: np.ndarray) -> None:
        for r in reqs.tolist():
            self.ctl.remove_request(f"r{r}")
            self.live.discard(f"r{r}")

    def lagged_choice(self, reqs: np.ndarray, drafted: np.ndarray, accepted: np.ndarray,
                      t: float | None) -> np.ndarray:
        """K for the next step from the feedback of `lag` steps before the last one (that of
        requests since finished is dropped, as the plugin drops it), the engine's order."""
        names = [f"r{r}" for r in reqs.tolist()]
        self.pending.append((names, np.asarray(drafted).copy(), np.asarray(accepted).copy(), t))
        if len(self.pending) > self.lag:
            ids, d, a, step_t = self.pending.popleft()
            keep = [i for i, r in enumerate(ids) if r in self.live]
            if keep:
                self.ctl.plan(StepFeedback([ids[i] for i in keep], d[keep], a[keep], step_t))
        return self.ctl.plan_for(names).k

    def choose(self, reqs: np.ndarray, drafted: np.ndarray, accepted: np.ndarray,
               last_ms: float | None) -> np.ndarray:
        t = None if last_ms is None else last_ms / 1e3
        if self.lag is not None:
            return self.lagged_choice(reqs, drafted, accepted, t)
        if self.chosen is None:
            return self.ctl.step(self.slots, drafted, accepted, t)
        ks = self.ctl.step(self.slots, drafted, accepted, t, sources=self.chosen)
        self.chosen = self.ctl.req_proposer[self.slots].copy()
        return ks

    def passes(self, proposer: int, ms: float, passes: int, catchup_tokens: int) -> None:
        self.ctl.record_pass_cost(proposer, ms, passes, catchup_tokens)


# ------------------------------------------------------------------------------ one run


@dataclass
class RunStats:
    """What one policy did at one load."""

    tokens: int
    time_ms: float
    steps: int
    drafted: int
    accepted: int
    request_steps: int
    itl: dict[str, dict[str, float]]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_ms * 1e3

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens_per_s": round(self.tokens_per_s, 4),
            "itl_ms": self.itl,
            "mean_k": round(self.drafted / max(self.request_steps, 1), 4),
            "acceptance": round(self.accepted / self.drafted, 4) if self.drafted else None,
            "steps": self.steps,
            "tokens": self.tokens,
            "simulated_s": round(self.time_ms / 1e3, 3),
        }


def _weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cum, q * cum[-1])])


def _itl_summary(names: list[str], cls: np.ndarray, gaps: np.ndarray,
                 emitted: np.ndarray) -> dict[str, dict[str, float]]:
    """Inter-token latency per class. A request that gets n tokens from a step of t ms waits
    t/n per token: the mean is sum(t) / sum(n), the p99 is over tokens (weights n). Both use
    expected step times: the jitter is the same for every policy, and leaving it out keeps
    what differs between policies (how long their steps are, how many tokens they bring)."""
    out = {}
    for c, name in enumerate(names):
        m = cls == c
        if not m.any():
            continue
        n, g = emitted[m], gaps[m]
        out[name] = {"mean": round(float((g * n).sum() / n.sum()), 4),
                     "p99": round(_weighted_quantile(g, n, 0.99), 4)}
    return out


def _model_passes(props: Proposers, chooser: Chooser, who: np.ndarray, ks: np.ndarray,
                  reqs: np.ndarray, pos: np.ndarray, acc: np.ndarray, synced: np.ndarray
                  ) -> float:
    """Time (ms) of the model proposers' passes in one step, told to the chooser per proposer:
    one pass per draft token of each request it drafts for, plus the catch-up over the tokens
    its cache is missing beyond the one new token (the prompt at first use, the tokens made
    while it was idle). Its cache then holds the accepted drafts."""
    total = 0.0
    for p in np.flatnonzero(props.pass_ms > 0).tolist():
        mine = (who == p) & (ks > 0)
        if not mine.any():
            continue
        r = reqs[mine]
        catchup = int(np.maximum(pos[mine] - synced[p, r] - 1, 0).sum())
        passes = int(ks[mine].sum())
        ms = props.pass_ms[p] * passes + props.catchup_ms[p] * catchup
        synced[p, r] = pos[mine] + acc[mine]
        total += ms
        report = getattr(chooser, "passes", None)
        if report is not None:
            report(p, ms, passes, catchup)
    return total


def simulate(stream: Stream, concurrency: int, n_done: int, cost: CostModel,
             noise: np.ndarray, chooser: Chooser, min_passes: int = 0) -> RunStats:
    """Run until `n_done` requests have finished; throughput counts every token emitted.
    min_passes: draft passes a step costs at least (a draft model makes its first pass even
    when nothing is drafted: 1)."""
    reqs = np.arange(concurrency)
    pos = np.zeros(concurrency, dtype=np.int64)
    length = stream.length
    chooser.admit(np.arange(concurrency), reqs)
    drafted = np.zeros(concurrency, dtype=np.int64)
    accepted = np.zeros(concurrency, dtype=np.int64)
    last_ms: float | None = None
    nxt, done, steps, total_ms, n_drafted, n_accepted = concurrency, 0, 0, 0.0, 0, 0
    log_cls, log_gap, log_n = [], [], []
    props = stream.proposers
    # Per proposer and request: the output position up to which a model proposer's cache is
    # current (its prompt is missing at first).
    synced = (None if props is None
              else np.tile(-props.prompt.astype(np.int64), (len(props.names), 1)))
    while done < n_done:
        ks = np.asarray(chooser.choose(reqs, drafted, accepted, last_ms), dtype=np.int64)
        if stream.avail is not None:
            ks = ks * stream.avail[reqs, pos]
        who = getattr(chooser, "chosen", None)
        k_top = int(ks.max(initial=0))
        if k_top > 0:
            cols = np.arange(k_top)
            coins = stream.coins[reqs[:, None], pos[:, None] + cols]
            alpha = (stream.alpha[reqs, :k_top] if props is None or who is None
                     else props.alpha[who, reqs, :k_top])
            ok = (coins < alpha) & (cols < ks[:, None])
            acc = np.cumprod(ok, axis=1).sum(axis=1)  # the run of accepted drafts from the start
        else:
            acc = np.zeros(concurrency, dtype=np.int64)
        # The target's own token follows the accepted drafts; nothing past the request's end.
        emitted = np.minimum(acc + 1, length[reqs] - pos)
        expected_ms = float(step_ms(cost, concurrency, int(ks.sum()), max(k_top, min_passes)))
        if props is not None and who is not None and synced is not None:
            expected_ms += _model_passes(props, chooser, who, ks, reqs, pos, acc, synced)
        last_ms = expected_ms * noise[steps % len(noise)]
        steps += 1
        # Throughput and ITL add up the step's expected time: the noise does not depend on the
        # plan, so this estimates the same expectation as the noisy times, with less variance
        # (policies that take the same steps then tie exactly). The controller, like a real
        # one, only sees the noisy measured time.
        total_ms += expected_ms
        n_drafted += int(ks.sum())
        n_accepted += int(acc.sum())
        log_cls.append(stream.cls[reqs])
        log_gap.append(expected_ms / emitted)
        log_n.append(emitted)
        pos += emitted
        drafted, accepted = ks, acc
        fin = np.flatnonzero(pos >= length[reqs])
        if fin.size:
            chooser.retire(reqs[fin])
            new = np.arange(nxt, nxt + fin.size)
            nxt += fin.size
            done += fin.size
            reqs = reqs.copy()
            reqs[fin] = new
            pos[fin] = 0
            drafted, accepted = ks.copy(), acc.copy()
            drafted[fin] = 0  # an arrival has no previous step to report
            accepted[fin] = 0
            if done < n_done:
                chooser.admit(fin, new)
    emitted_all = np.concatenate(log_n)
    return RunStats(
        tokens=int(emitted_all.sum()), time_ms=total_ms, steps=steps, drafted=n_drafted,
        accepted=n_accepted, request_steps=len(emitted_all),
        itl=_itl_summary(stream.names, np.concatenate(log_cls), np.concatenate(log_gap),
                         emitted_all),
    )
