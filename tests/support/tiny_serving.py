"""The tests' policy for the tiny pair, and `adaptspec serve` on it, written once.

Free drafting in the cost model: the tiny model's steps are too cheap to pay for drafts, so the
learned step-time curve (or the payoff guard) would otherwise (rightly) turn speculation off;
with it, acceptance alone decides, and speculation really happens.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

TEST_POLICY = """
version: 1
default_class: code
k_max: 4
exploration: 0.0
hysteresis_steps: 1
cost_model: {base_ms: 10, per_request_ms: 0.1, per_draft_token_ms: 0.0, spec_overhead_ms: 0.0,
             knee_tokens: 100000, over_knee_ms: 0.0, learn: false}
classes:
  code: {prior_acceptance: 0.6, prior_strength: 2}
  noisy: {prior_acceptance: 0.6, prior_strength: 2}
  interactive: {latency_critical: true}
# The payoff guard would (rightly) hold speculation on the tiny model too.
payoff: {enabled: false}
"""


def policy_text(**keys: Any) -> str:
    """TEST_POLICY with top-level `keys` set (values written as JSON, which YAML reads): a key
    it has is replaced where it stands (`classes` as a whole), the others are added at the end."""
    text = TEST_POLICY
    for key, value in keys.items():
        line = f"{key}: {json.dumps(value)}\n"
        # the key's line and its indented continuation lines
        entry = re.compile(rf"^{re.escape(key)}:.*\n(?:[ \t]+.*\n)*", re.M)
        text, found = entry.subn(lambda _m, line=line: line, text, count=1)
        if not found:
            text += line
    return text


def priced_policy_text(**keys: Any) -> str:
    """The tests' policy with a fixed step-time curve where a draft token costs 2% of a step, no
    learning: on the tiny model a step is so cheap that the learned cost model (rightly) turns
    speculation off for everyone, which would hide what is tested; K then depends on acceptance
    alone. A wide latency_critical_slack, so code requests may speculate in the same steps as
    interactive ones (which themselves never draft); how the slack limits others is covered by
    the controller's unit tests. `keys` as for policy_text."""
    cost = {"base_ms": 10, "per_request_ms": 0.1, "per_draft_token_ms": 0.2,
            "spec_overhead_ms": 0.0, "knee_tokens": 100000, "over_knee_ms": 0.0, "learn": False}
    return policy_text(cost_model=cost, latency_critical_slack=0.5, **keys)


def serve_command(model: str, policy: str, port: int, *extra: str,
                  max_num_seqs: int = 8, max_model_len: int = 512) -> list[str]:
    """`adaptspec serve` as a user runs it, on the tiny target (float32, eager, 512 tokens unless
    told), named `tiny`; `extra` goes to it as given."""
    return [sys.executable, "-m", "adaptspec.cli", "serve", model, "--policy", policy,
            "--port", str(port), "--dtype", "float32", "--max-model-len", str(max_model_len),
            "--max-num-seqs", str(max_num_seqs), "--enforce-eager", "--served-model-name", "tiny",
            *extra]
