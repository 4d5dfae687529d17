"""What any K policy over vLLM's n-gram can gain on the unseen chat cell: an exact replay.

Greedy decoding makes every configuration produce the same tokens, and vLLM's n-gram proposal at
a position depends only on the tokens so far. So from plain decoding's outputs alone, the draft
vLLM's n-gram makes at every position of every request (lookup 2 to 4, 8 tokens: a K=k proposal
is the first k tokens of the same match) and how many of its tokens greedy verification accepts
are known exactly. This script computes them and replays `bench unseen`'s stream without the
latency-critical request (slices of 2C requests, taken in order by C closed-loop clients, 64
tokens each; a prefill step, then decode steps) step by step under:

- `K=k`: vLLM's static n-gram, every request with a match drafts min(k, proposed) tokens;
- `bylenA,B,C` (`--bylen`): K by the length of the match (A after 2 tokens, B after 3, C 4);
- three that know the future, the most a K policy over this proposer could do: `first2` (K=2
  where the first token will be accepted, else nothing), `oracle2` (the tokens that will be
  accepted, at most 2), `oracle` (exactly the tokens that will be accepted);
- `adaptspec/N`: adaptspec's own runtime over vLLM's n-gram, driven as its scheduler drives it
  (`Adaptspec`), seeing the replayed step times with 5% noise (seed N).

A decode step costs `step_ms(curve, B, S)`; the default curve is what `bench unseen`'s servers
measured (CURVE), `--curve` takes another (a GPU's, say). Prints per policy the decode steps,
draft tokens verified and accepted, and the replayed wall time over static K=2's, in all and
slice by slice. Simulated time (a fitted curve: no jitter, no first uses of a shape, no CPU
the controller itself takes); the token counts are exact. docs/unseen.md reads it.

    python bench/ngram_ceiling.py [--prompts 32] [--per-client 2] [--curve ...] [--json OUT]
        [--outputs GREEDY.json] [--adaptspec N] [--policy POLICY] [--bylen bylen2,2,4 ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

MAX_TOKENS = 64
K_MAX = 8
LOOKUP = (2, 4)
# A decode step as `bench unseen`'s servers measured it (their engine accounts, 420 slices in
# bench/results/unseen*.json, each step's time over its own server's plain step at 4
# requests): plain steps of 1, 3, 4 and 5 requests within 3% of each other (2: 19% dearer, not
# modelled), and a speculating step at 4 requests 3.1% + 3.8% a draft token dearer than a plain
# one; in ms of a 130 ms plain step. A prefill costs 8 ms a prompt token (the accounts' prefill
# steps: about 1 s, 7.5 plain steps, for a slice's prompt of 118 tokens).
CURVE = (130.0, 0.0, 4.9, 4.0, 0.0, 0.0)
PREFILL_MS_PER_TOKEN = 8.0


def greedy_outputs(model: str, n: int) -> list[tuple[list[int], list[int]]]:
    """(prompt token ids, output token ids) of plain greedy decoding of the short unseen
    prompts, 64 tokens each with ignore_eos, as `bench unseen` sends them."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.path.insert(0, str(Path(__file__).parent))
    import engine_ab
    from vllm import SamplingParams

    from adaptspec.tools.bench.prompts import load_unseen_chat

    llm = engine_ab.build("plain", model)
    chats = [[{"role": "user", "content": d["prompt"]}] for d in load_unseen_chat()["short"][:n]]
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.chat(chats, sp, use_tqdm=False)
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]


def proposal(context: np.ndarray, k: int) -> np.ndarray:
    """vLLM's n-gram proposal (its own function, run as plain Python)."""
    from vllm.v1.spec_decode.ngram_proposer import (
        _find_longest_matched_ngram_and_propose_tokens as find,
    )

    fn = getattr(find, "py_func", find)
    return fn(context, LOOKUP[0], LOOKUP[1], 1 << 20, k)


def matched_n(context: list[int]) -> int:
    """The longest n in LOOKUP whose last n tokens occur earlier in the context (the n-gram
    the proposal continues), 0 for none."""
    for n in range(LOOKUP[1], LOOKUP[0] - 1, -1):
        tail = context[-n:]
        if any(context[i:i + n] == tail for i in range(len(context) - n)):
            return n
    return 0


class Request:
    """One request of the replay: its tokens, and per count n of tokens made (1 to its length
    less one) the 8-token draft `propose` (vLLM's n-gram) makes then (`drafts`), how many of
    its leading tokens greedy decoding accepts (`accepted`) and the matched n-gram's length
    (`ngram`)."""

    def __init__(self, prompt: list[int], out: list[int],
                 propose: Callable[[np.ndarray, int], Sequence[int]] = proposal) -> None:
        self.prompt, self.out, self.length = prompt, out, len(out)
        self.drafts: list[list[int]] = [[]]
        self.accepted = np.zeros(self.length, dtype=np.int64)
        self.ngram = np.zeros(self.length, dtype=np.int64)
        for n in range(1, self.length):
            context = prompt + out[:n]
            d = [int(t) for t in propose(np.asarray(context, dtype=np.int32), K_MAX)]
            self.drafts.append(d)
            self.ngram[n] = matched_n(context) if d else 0
            truth = out[n:n + K_MAX]
            a = 0
            while a < min(len(d), len(truth)) and d[a] == truth[a]:
                a += 1
            self.accepted[n] = a


def step_ms(curve: Sequence[float], batch: int, spec: int) -> float:
    """A decode step's ms: base + per_request*B + per_draft_token*S + spec*[S > 0] +
    over_knee*max(0, B + S - knee), B requests decoding, S draft tokens verified."""
    base, per_request, per_token, spec_ms, knee, over_knee = curve
    return (base + per_request * batch + per_token * spec + spec_ms * (spec > 0)
            + over_knee * max(0.0, batch + spec - knee))


def draft_len(policy: str, proposed: int, accepted: int, ngram: int) -> int:
    """The draft tokens a request verifies under a policy, at one position: `proposed` the
    8-token proposal's length there, `accepted` how many of them greedy decoding accepts,
    `ngram` the matched n-gram's length. Policies: "K" (an integer: vLLM's static n-gram),
    "bylenA,B,C" (K by the match: A after 2 tokens, B after 3, C after 4), and three that
    know the future: "first2" (K=2 where the first token is accepted, else 0), "oracle2"
    (the tokens accepted, at most 2), "oracle" (the tokens accepted)."""
    if policy == "oracle":
        return accepted
    if policy == "oracle2":
        return min(2, accepted)
    if policy == "first2":
        return min(2, proposed) if accepted else 0
    if policy.startswith("bylen"):
        by_n = [0, 0] + [int(x) for x in policy[5:].split(",")]
        return min(proposed, by_n[ngram])
    return min(int(policy), proposed)


class Rule:
    """A policy of `draft_len`'s, which needs no feedback."""

    def __init__(self, policy: str) -> None:
        self.policy = policy

    def admit(self, r: int) -> None:
        pass

    def feedback(self, reqs: list[int], drafted: list[int], accepted: list[int],
                 step_s: float | None, finished: list[int]) -> None:
        pass

    def drafts(self, made: dict[int, int], requests: list[Request]) -> dict[int, int]:
        return {r: draft_len(self.policy, len(requests[r].drafts[n]),
                             int(requests[r].accepted[n]), int(requests[r].ngram[n]))
                for r, n in made.items()}


class Adaptspec:
    """adaptspec over vLLM's n-gram, driven as its scheduler drives it (plugins/vllm/
    scheduler.py): each step's feedback (`AdaptiveRuntime.step`, with the step's time where it
    prefilled nothing), then the drafts as proposed, each scored by its request's drafting
    record (`DraftRecords`), cut and trimmed (`AdaptiveRuntime.keep_drafts`). The
    controller sees step times with `noise` (lognormal sigma), as a server's vary."""

    def __init__(self, policy: str, noise: float = 0.05, seed: int = 0,
                 preset: str | None = None) -> None:
        from adaptspec.classify import RequestInfo
        from adaptspec.policy import load_policy
        from adaptspec.proposers.record import DraftRecords, lookup_prior
        from adaptspec.runtime import AdaptiveRuntime
        from adaptspec.tools.simulator.engine import controller_policy

        # (a preset named: the policy's cost prior is that hardware's, as a deployment sets it)
        self.rt = AdaptiveRuntime(controller_policy(load_policy(policy), preset, "engine"),
                                  k_cap=K_MAX)
        self.records = DraftRecords(lookup_prior(LOOKUP[1]))
        self.info = RequestInfo()
        self.rng = np.random.default_rng(seed)
        self.noise = noise

    def admit(self, r: int) -> None:
        self.rt.admit(f"r{r}", self.info)

    def feedback(self, reqs: list[int], drafted: list[int], accepted: list[int],
                 step_s: float | None, finished: list[int]) -> None:
        if step_s is not None:
            step_s *= float(self.rng.lognormal(0.0, self.noise))
        self.rt.step([f"r{r}" for r in reqs], drafted, accepted, step_s)
        for r in finished:
            self.rt.finish(f"r{r}")
            self.records.remove(f"r{r}")

    def drafts(self, made: dict[int, int], requests: list[Request]) -> dict[int, int]:
        ids = [f"r{r}" for r in made]
        lengths = [len(requests[r].drafts[n]) for r, n in made.items()]
        conf = [self.records.confidence(rid, requests[r].prompt + requests[r].out[:n],
                                        requests[r].drafts[n]) if d else math.nan
                for rid, (r, n), d in zip(ids, made.items(), lengths, strict=True)]
        return dict(zip(made, self.rt.keep_drafts(ids, lengths, conf), strict=True))


def replay(requests: list[Request], policy: Rule | Adaptspec, curve: Sequence[float],
           prefill_ms_per_token: float, clients: int, per_client: int = 2) -> dict[str, Any]:
    """The stream under a policy, in slices of per_client * clients requests that the clients
    take in order as they free up; a request's prefill step makes its first token (its prompt
    priced per token), each decode step verifies the drafts the policy chose after the last
    step and makes accepted + 1 (`step_ms` of its B requests decoding and S draft tokens).
    Per slice: wall ms, decode steps, draft tokens verified and accepted."""
    size = per_client * clients
    slices = []
    for s0 in range(0, len(requests), size):
        queue = list(range(s0, min(s0 + size, len(requests))))
        made: dict[int, int] = {}  # running request -> tokens made (0: not prefilled)
        k: dict[int, int] = {}  # running request -> draft tokens to verify next
        wall = steps = drafted = accepted = 0.0
        while queue or made:
            while queue and len(made) < clients:
                made[queue[0]] = 0
                policy.admit(queue.pop(0))
            new = [r for r, n in made.items() if n == 0]
            decoding = [r for r, n in made.items() if n > 0]
            spec = sum(k.get(r, 0) for r in decoding)
            ms = step_ms(curve, len(decoding), spec) if decoding else 0.0
            steps += bool(decoding)
            ms += prefill_ms_per_token * sum(len(requests[r].prompt) for r in new)
            wall += ms
            got = []
            for r in decoding:
                got.append(min(k.get(r, 0), int(requests[r].accepted[made[r]])))
                made[r] = min(made[r] + got[-1] + 1, requests[r].length)
            drafted += spec
            accepted += sum(got)
            for r in new:
                made[r] = 1
            done = [r for r, n in made.items() if n >= requests[r].length]
            policy.feedback(decoding + new, [k.get(r, 0) for r in decoding] + [0] * len(new),
                            got + [0] * len(new), None if new else ms / 1e3, done)
            for r in done:
                del made[r]
            k = policy.drafts(made, requests)
        slices.append({"wall_ms": wall, "steps": steps, "drafted": drafted,
                       "accepted": accepted})
    return {"slices": slices, "wall_ms": sum(s["wall_ms"] for s in slices)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--model", default="~/.cache/adaptspec/models/qwen/draft")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--per-client", type=int, default=2,
                    help="requests per client in a slice (bench unseen: 2)")
    ap.add_argument("--curve", type=float, nargs=6, default=CURVE,
                    metavar=("BASE", "PER_REQUEST", "PER_DRAFT_TOKEN", "SPEC", "KNEE",
                             "OVER_KNEE"), help="the decode step's ms (step_ms)")
    ap.add_argument("--prefill-ms-per-token", type=float, default=PREFILL_MS_PER_TOKEN)
    ap.add_argument("--outputs", type=Path, default=None,
                    help="cache of the greedy outputs (written when missing)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--adaptspec", type=int, default=3, metavar="N",
                    help="replay adaptspec over vLLM's n-gram N times (seeds 0..N-1 of its "
                    "measured step times' noise)")
    ap.add_argument("--policy", default="default", help="adaptspec's policy")
    ap.add_argument("--preset", choices=["cpu", "gpu"], default=None,
                    help="adaptspec's step-time prior (default: the policy's)")
    ap.add_argument("--bylen", nargs="*", default=[],
                    help="policies bylenA,B,C: K=A after a 2-token match, B after 3, C after 4")
    args = ap.parse_args(argv)
    if args.outputs and args.outputs.exists():
        pairs = json.loads(args.outputs.read_text())
    else:
        pairs = greedy_outputs(args.model, args.prompts)
        if args.outputs:
            args.outputs.write_text(json.dumps(pairs))
    requests = [Request(p, o) for p, o in pairs]
    curve = tuple(args.curve)
    names = ["0", "1", "2", "3", "4", "8", "first2", "oracle2", "oracle", *args.bylen]
    runs = {name: replay(requests, Rule(name), curve, args.prefill_ms_per_token, args.clients,
                         args.per_client) for name in names}
    for seed in range(args.adaptspec):
        policy = Adaptspec(args.policy, seed=seed, preset=args.preset)
        runs[f"adaptspec/{seed}"] = replay(requests, policy, curve, args.prefill_ms_per_token,
                                           args.clients, args.per_client)
    ref = runs["2"]
    print(f"step ms (base, per request, per draft token, spec, knee, over knee): {curve}")
    print(f"{'policy':>12} {'steps':>6} {'drafted':>8} {'accepted':>9} {'wall x K=2':>11}"
          "  by slice")
    for name, r in runs.items():
        steps = sum(s["steps"] for s in r["slices"])
        dr = sum(s["drafted"] for s in r["slices"])
        ac = sum(s["accepted"] for s in r["slices"])
        per = " ".join(f"{a['wall_ms'] / b['wall_ms']:.3f}"
                       for a, b in zip(ref["slices"], r["slices"], strict=True))
        label = ("plain" if name == "0" else f"K={name}" if name.isdigit() else name)
        print(f"{label:>12} {steps:6.0f} {dr:8.0f} {ac:9.0f} {ref['wall_ms'] / r['wall_ms']:11.3f}"
              f"  {per}")
    if args.json:
        args.json.write_text(json.dumps({"curve": curve, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
