"""The simulator's gpu step-time preset against published measurements (published.py):
it reproduces the vLLM PR #32374 table within the fit's own error, ranks fixed K by batch as
that table does, and agrees loosely with the 2601.11580 predictor."""

from __future__ import annotations

import numpy as np
import pytest

from adaptspec.cost import StepCostModel, step_time
from adaptspec.policy import COST_PRESETS, CostModel
from adaptspec.tools.simulator import step_ms
from adaptspec.tools.simulator.published import (
    PR32374_BATCHES,
    PR32374_BEST_K,
    PR32374_KS,
    PR32374_STEP_MS,
    best_fixed_k,
    illusion_step_ms,
)

# The fit's largest cell error (fit_gpu.py, rank=True: 0.0757), plus 0.001 for the coefficients
# being stored to 4 significant figures. Not chosen to pass: it is what the 7-term form reaches
# on this table (test_preset_is_the_fit re-runs the fit).
FIT_MAX_REL_ERROR = 0.0757
TOLERANCE = FIT_MAX_REL_ERROR + 0.001


def _gpu() -> CostModel:
    return CostModel(preset="gpu", learn=False)


def _preset_ms(cfg: CostModel, batch: int, k: int) -> float:
    """The simulator's engine step time with K drafts for every one of `batch` requests."""
    return float(step_ms(cfg, batch, batch * k, k))


def _errors(cfg: CostModel) -> np.ndarray:
    return np.array([[_preset_ms(cfg, b, k) / PR32374_STEP_MS[i, j] - 1
                      for j, k in enumerate(PR32374_KS)]
                     for i, b in enumerate(PR32374_BATCHES)])


def test_published_table_implies_the_published_best_k() -> None:
    for i, b in enumerate(PR32374_BATCHES):
        measured = dict(zip(PR32374_KS, PR32374_STEP_MS[i], strict=True))
        assert best_fixed_k(measured, b) == PR32374_BEST_K[b]


def test_preset_reproduces_every_cell_of_the_table() -> None:
    err = _errors(_gpu())
    table = "\n".join(f"B={b:>3}: " + "  ".join(f"K={k} {e:+.1%}" for k, e in
                                                 zip(PR32374_KS, row, strict=True))
                      for b, row in zip(PR32374_BATCHES, err, strict=True))
    print("\ngpu preset / PR #32374 - 1, per cell:\n" + table)
    assert np.abs(err).max() <= TOLERANCE, table
    # a Chebyshev fit leaves its largest error on several cells: the tolerance is that error
    assert np.abs(err).max() >= FIT_MAX_REL_ERROR - 0.001, table


def test_learned_model_starts_from_the_same_curve() -> None:
    cfg = _gpu()
    prior = StepCostModel(cfg)
    for b in PR32374_BATCHES:
        for k in PR32374_KS:
            assert step_time(prior.coef, b, b * k * 1.0, k * 1.0, prior.knee) == pytest.approx(
                _preset_ms(cfg, b, k))


@pytest.mark.parametrize("batch", PR32374_BATCHES)
def test_best_fixed_k_by_batch_is_the_published_one(batch: int) -> None:
    cfg = _gpu()
    ms = {k: _preset_ms(cfg, batch, k) for k in PR32374_KS}
    assert best_fixed_k(ms, batch) == PR32374_BEST_K[batch]


def test_preset_is_the_fit() -> None:
    """The stored preset is fit_gpu's output, and the published ranking at batches 64 and 256 is
    kept by the fit's constraint, not predicted: the unconstrained fit (6.2% largest error)
    ranks K=3 first at 64 and K=1 at 256. The published margins there (3% between K=1 and K=3
    at 64) are within the form's fit error."""
    pytest.importorskip("scipy")
    from adaptspec.tools.simulator.fit_gpu import fit_step_table

    fit = fit_step_table(rank=True)
    assert fit["max_rel_error"] == pytest.approx(FIT_MAX_REL_ERROR, abs=5e-5)
    for name, v in fit["preset"].items():
        assert COST_PRESETS["gpu"][name] == pytest.approx(v, rel=1e-3, abs=1e-6), name

    free = fit_step_table(rank=False)
    assert free["max_rel_error"] < fit["max_rel_error"]
    cfg = CostModel(**free["preset"], learn=False)
    ranked = {b: best_fixed_k({k: _preset_ms(cfg, b, k) for k in PR32374_KS}, b)
              for b in PR32374_BATCHES}
    assert ranked == {1: 3, 4: 3, 16: 3, 64: 3, 256: 1}


# 2601.11580's Llama8BH100 predictor needs a context length for its KV term: MT-Bench turns are
# a few hundred tokens. At 512 its step times exceed the preset's by 18-27% at K=0 (its fixed
# costs are higher: another vLLM version) and lie within -15..+27% at K=3.
CONTEXT = 512


@pytest.mark.parametrize("batch", [1, 16, 64, 256])
@pytest.mark.parametrize("k", [0, 3])
def test_second_source_agrees_loosely(batch: int, k: int) -> None:
    ratio = illusion_step_ms(batch, k, CONTEXT) / _preset_ms(_gpu(), batch, k)
    assert 0.7 < ratio < 1.3


def test_both_sources_see_the_compute_bound_regime() -> None:
    """From batch 64 to 256 a plain step grows by about 2x in both, while from 1 to 16 it
    grows by a few percent (the memory-bound flat region)."""
    cfg = _gpu()
    for f in (lambda b: _preset_ms(cfg, b, 0), lambda b: illusion_step_ms(b, 0, CONTEXT)):
        assert f(16) / f(1) < 1.1
        assert 1.7 < f(256) / f(64) < 2.1
