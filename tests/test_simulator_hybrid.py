"""The simulator's hybrid: the controller chooses who drafts per class, a model proposer's passes
and catch-up are priced, and the calibration predicts hybrid cells from their acceptance."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from adaptspec.policy import CostModel, Policy, policy_from_dict
from adaptspec.tools import simulator as sim
from adaptspec.tools.bench import calibrate, calibrate_hybrid, stepfit

# Two classes, two proposers, each good where the other is poor (shared/MODELS.md: the draft
# model ~1.0 on math where n-gram gets 0.28; n-gram strong on code).
TRUTH = {"ngram": {"code": 0.9, "math": 0.15}, "draft": {"code": 0.3, "math": 0.85}}
N, WIDTH, LENGTH = 240, 4, 48


@pytest.fixture(scope="module")
def policy() -> Policy:
    return policy_from_dict({"default_class": "code", "k_max": WIDTH,
                             "classes": {"code": {}, "math": {}}})


def _stream(pass_ms: float = 0.0, catchup_ms: float = 0.0, single: str | None = None,
            prompt: int = 0) -> sim.Stream:
    rng = np.random.default_rng(7)
    cls = rng.permutation(np.arange(N) % 2)
    names = ["code", "math"]
    props = (single,) if single else tuple(TRUTH)
    alpha = np.stack([np.array([TRUTH[p][names[c]] for c in cls])[:, None] * np.ones(WIDTH)
                      for p in props])
    coins = rng.random((N, LENGTH + WIDTH), dtype=np.float32)
    length = np.full(N, LENGTH, dtype=np.int64)
    if single:
        return sim.Stream(names, cls, length, alpha[0], coins)
    cost = np.array([0.0, pass_ms])  # ("ngram", "draft")
    return sim.Stream(names, cls, length, alpha[0], coins, proposers=sim.Proposers(
        props, alpha, cost, np.array([0.0, catchup_ms]), np.full(N, prompt, dtype=np.int64)))


class _Counting(sim.Adaptive):
    """The hybrid, counting its choices per class and the passes it was told of."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.chose = np.zeros((2, 2))  # class x proposer, speculating request-steps
        self.reported = np.zeros(3)  # ms, passes, catch-up tokens

    def choose(self, reqs: np.ndarray, drafted: np.ndarray, accepted: np.ndarray,
               last_ms: float | None) -> np.ndarray:
        ks = super().choose(reqs, drafted, accepted, last_ms)
        who = np.zeros_like(ks) if self.chosen is None else self.chosen
        np.add.at(self.chose, (self.cls[reqs][ks > 0], who[ks > 0]), 1)
        return ks

    def passes(self, proposer: int, ms: float, passes: int, catchup_tokens: int) -> None:
        super().passes(proposer, ms, passes, catchup_tokens)
        self.reported += (ms, passes, catchup_tokens)


def _run(stream: sim.Stream, policy: Policy, chooser: Any = None, conc: int = 4
         ) -> tuple[sim.RunStats, Any]:
    cost = CostModel(preset="cpu")
    chooser = chooser or _Counting(policy, stream, conc, 0)
    return sim.simulate(stream, conc, N - conc, cost, np.ones(64), chooser), chooser


def test_the_hybrid_drafts_each_class_with_its_better_proposer(policy: Policy) -> None:
    hybrid, ch = _run(_stream(), policy)
    share = ch.chose / ch.chose.sum(axis=1, keepdims=True)
    assert share[0, 0] > 0.8 and share[1, 1] > 0.8, share  # code: n-gram; math: draft
    # Either proposer alone serves one class well and the other badly.
    for p in TRUTH:
        single, _ = _run(_stream(single=p), policy, None)
        assert hybrid.tokens_per_s > single.tokens_per_s, p
        # (tokens per request-step: the n-gram alone leaves math plain, at a high acceptance)
        assert (hybrid.tokens / hybrid.request_steps > single.tokens / single.request_steps), p


def test_a_model_proposer_is_priced_by_its_passes_and_catch_up(policy: Policy) -> None:
    plain_ms = float(sim.step_ms(CostModel(preset="cpu"), 4, 0, 0))
    cheap, c1 = _run(_stream(pass_ms=0.02 * plain_ms, catchup_ms=0.01 * plain_ms, prompt=30),
                     policy)
    dear, c2 = _run(_stream(pass_ms=3.0 * plain_ms, prompt=30), policy)
    assert c1.reported[1] > 0 and c1.chose[1, 1] > c1.chose[1, 0]
    # The first use of the draft catches up on the prompt: at least one prompt per request it
    # drafted for, besides the draft's passes.
    assert c1.reported[2] >= 29
    # A pass that costs three plain steps never pays back: the controller learns that and
    # hardly uses the draft model after trying it.
    assert c2.reported[1] < 0.1 * c1.reported[1]
    assert cheap.tokens_per_s > dear.tokens_per_s


class _Scripted:
    """Draft model on steps 0 and 4, nothing in between (K = 2 for the one request)."""

    def __init__(self) -> None:
        self.chosen = np.ones(1, dtype=np.int64)
        self.step = 0
        self.reported: list[tuple[int, float, int, int]] = []

    def admit(self, positions: np.ndarray, reqs: np.ndarray) -> None: ...

    def retire(self, reqs: np.ndarray) -> None: ...

    def choose(self, reqs: np.ndarray, drafted: np.ndarray, accepted: np.ndarray,
               last_ms: float | None) -> np.ndarray:
        k = 2 if self.step in (0, 4) else 0
        self.step += 1
        return np.array([k])

    def passes(self, proposer: int, ms: float, passes: int, catchup_tokens: int) -> None:
        self.reported.append((proposer, ms, passes, catchup_tokens))


def test_catch_up_counts_the_prompt_and_the_tokens_made_while_idle() -> None:
    n, width = 2, 2
    alpha = np.ones((2, n, width))  # every draft accepted
    stream = sim.Stream(["a"], np.zeros(n, dtype=np.int64), np.full(n, 40, dtype=np.int64),
                        alpha[0], np.zeros((n, 40 + width), dtype=np.float32),
                        proposers=sim.Proposers(("ngram", "draft"), alpha, np.array([0.0, 10.0]),
                                                np.array([0.0, 1.0]), np.array([20, 20])))
    chooser = _Scripted()
    sim.simulate(stream, 1, 1, CostModel(preset="cpu"), np.ones(4), chooser)
    # Step 0 at position 0: the 20-token prompt (less the one new token). It accepts 2 and the
    # target adds 1: position 3, then 3 plain steps to 6; at step 4 the cache holds 2 tokens of
    # output: 6 - 2 - 1 = 3 tokens to catch up.
    assert chooser.reported[:2] == [(1, 2 * 10.0 + 19 * 1.0, 2, 19), (1, 2 * 10.0 + 3.0, 2, 3)]


# ------------------------------------------------------------------ calibration of hybrids


def _hybrid_result(draft_cost: bool = False) -> dict[str, Any]:
    """A benchmark with plain decoding, a static n-gram K = 2 and a model-free hybrid whose cells
    record each proposer's decisions, drafts and acceptance: drafts of K = 2 accepted at the
    per-position rate of TRUTH (expected values)."""
    def cell(conc: int, kind: str) -> dict[str, Any]:
        step = {1: 60.0, 4: 52.0}[conc]
        classes = {}
        tokens = 0.0
        steps = 0.0
        hybrid = kind == "hybrid"
        for cls in ("code", "math"):
            p = "ngram" if cls == "code" else "suffix"
            a = TRUTH["ngram" if cls == "code" or not hybrid else "draft"][cls]
            per = (1 + a + a * a) if kind != "none" else 1.0
            n_steps = 2 * conc * 31 / per
            steps += n_steps
            tokens += 2 * conc * 32
            classes[cls] = {"requests": 2 * conc, "acceptance_length": per}
            if hybrid:
                classes[cls]["k_distribution"] = {"2": n_steps}
                classes[cls]["proposers"] = {
                    p: {"decisions": n_steps, "drafted": 2 * n_steps,
                        "accepted": (a + a * a) * n_steps},
                    ("draft" if draft_cost else "other"): {"decisions": 0.0, "drafted": 0.0,
                                                          "accepted": 0.0}}
        engine_steps = steps / conc
        drafts = kind != "none"
        ms = step + (3.0 * 2 * conc if drafts else 0.0)  # the verify pass's draft tokens
        wall = engine_steps * ms / 1e3
        return {"tok_per_s": tokens / wall, "request_steps": steps, "wall_s": wall,
                "output_tokens": tokens, "decode_tokens": tokens - 4 * conc,
                "vllm_draft_tokens": 2 * steps if drafts else 0.0,
                "vllm_drafts": steps if drafts else 0.0, "classes": classes,
                "engine_steps": {"decode": {str(conc): [engine_steps, ms, tokens - 4 * conc]},
                                 "other_s": 0.0, "steps": engine_steps + 4 * conc}}
    configs = [{"name": "none", "spec": None, "adaptive": False},
               {"name": "vllm_ngram_k2", "adaptive": False,
                "spec": {"method": "ngram", "num_speculative_tokens": 2}},
               {"name": "adaptspec_hybrid", "adaptive": True,
                "spec": {"method": "custom_class", "num_speculative_tokens": 8}}]
    kinds = {"none": "none", "vllm_ngram_k2": "static", "adaptspec_hybrid": "hybrid"}
    summary = {c["name"]: {str(conc): cell(conc, kinds[c["name"]]) for conc in (1, 4)}
               for c in configs}
    return {"configs": configs, "summary": summary, "policy": None,
            "sizes": {"max_tokens": 32, "interactive_tokens": 16}}


def test_per_proposer_acceptance_is_inverted_from_the_cells() -> None:
    result = _hybrid_result()
    # (in the hybrid server's order, the others after)
    assert calibrate_hybrid.hybrid_configs(result) == {"adaptspec_hybrid": ["ngram", "suffix",
                                                                            "other"]}
    alphas = calibrate_hybrid.proposer_alphas(result, "adaptspec_hybrid", ["1", "4"],
                                              ["ngram", "suffix", "other"])
    assert alphas is not None
    assert alphas["ngram"]["code"] == pytest.approx(0.9, abs=1e-4)
    assert alphas["suffix"]["math"] == pytest.approx(0.85, abs=1e-4)
    # a class the proposer never drafted for takes its pooled rate ("*"); one never used: 0
    assert "math" not in alphas["ngram"] and alphas["ngram"]["*"] == pytest.approx(0.9, 1e-3)
    assert alphas["other"]["*"] == 0.0


def test_hybrid_cells_are_predicted_in_and_out_of_sample() -> None:
    # The synthetic engine drafted K = 2 with the proposer good for each class, which is what
    # a controller allowed K <= 2 does at these acceptances and a 3 ms draft token.
    policy = policy_from_dict({"default_class": "code", "k_max": 2,
                               "classes": {"code": {}, "math": {}}})
    result = _hybrid_result()
    rows, cells = stepfit.observations(result)
    fitted = stepfit.fit_cost(rows)
    check = calibrate_hybrid.hybrid_check(result, rows, cells, calibrate.cost_at(fitted), policy)
    kinds = {(c["concurrency"], c["in_fit"]) for c in check["cells"]}
    assert kinds == {(1, True), (1, False), (4, True), (4, False)}
    assert all(np.isfinite(c["error"]) for c in check["cells"])
    # the synthetic engine follows the simulator's model: both land within the tolerance
    assert check["worst_error_in_sample"] <= stepfit.TOLERANCE
    assert check["worst_error_out_of_sample"] <= stepfit.TOLERANCE
    assert check["alpha"]["adaptspec_hybrid c=1"]["ngram"]["code"] == pytest.approx(0.9, 1e-3)
    report = calibrate.format_report({**calibrate.calibrate(result, policy)})
    assert "simulated hybrid" in report and "out of sample" in report


def test_a_hybrid_with_a_draft_model_needs_its_cost(policy: Policy) -> None:
    result = _hybrid_result(draft_cost=True)
    rows, cells = stepfit.observations(result)
    check = calibrate_hybrid.hybrid_check(result, rows, cells,
                                          calibrate.cost_at(stepfit.fit_cost(rows)), policy)
    assert check["cells"] == []
    assert "cost is not recorded" in check["skipped"]["adaptspec_hybrid"]
    # with the controller's fit of the draft model's cost in every cell, it is simulated
    for cell in result["summary"]["adaptspec_hybrid"].values():
        cell["draft_model_cost_ms"] = {"per_token": 1.0, "per_catchup_token": 0.1}
    check = calibrate_hybrid.hybrid_check(result, rows, cells,
                                          calibrate.cost_at(stepfit.fit_cost(rows)), policy)
    assert check["cells"] and not check["skipped"]
