"""`adaptspec` command line: policy checks, the simulator, benchmarks, models, the server."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

from adaptspec.policy import PolicyError, load_policy


def _write_json(path: str | None, data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        print(f"wrote {path}")


def cmd_policy_check(args: argparse.Namespace) -> int:
    policy = load_policy(args.file)
    print(f"{args.file}: OK")
    print(json.dumps(policy.model_dump(mode="json", by_alias=True), indent=2))
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from adaptspec.tools.simulator import format_table, run_simulation

    policy = load_policy(args.policy)
    if args.prior_check:
        from adaptspec.tools.simulator.prior import format_sweep, sweep

        rows = sweep(policy, seeds=args.seeds)
        print(format_sweep(rows))
        print("SIMULATED: the gpu preset as the controller's prior, the engine's true curve the "
              "preset made 0/20/30% cheaper at large batch; PR #32374's EAGLE acceptance")
        _write_json(args.json, {"prior_check": rows})
        return 0
    result = run_simulation(
        policy, args.workload, preset=args.preset, seed=args.seed, quick=args.quick,
        progress=lambda msg: print(msg, file=sys.stderr, flush=True), lag=args.lag,
    )
    print(format_table(result))
    _write_json(args.json, result)
    return 0


def cmd_bench_trace(args: argparse.Namespace) -> int:
    from adaptspec.tools.bench.trace import run

    return run(args)


def cmd_bench_queues(args: argparse.Namespace) -> int:
    from adaptspec.tools.bench.queues import run

    return run(args)


def cmd_bench_decide(args: argparse.Namespace) -> int:
    from adaptspec.policy import CostModel
    from adaptspec.tools.bench.decide import time_decisions

    policy = load_policy(args.policy)
    if args.preset:
        policy = policy.model_copy(update={"cost_model": CostModel(preset=args.preset)})
    # Two batches per size: the policy's classes in turn (latency-critical ones too, which hold
    # a batch at K = 0 where the cost model says speculating slows them), and only the classes
    # that may speculate, so that feedback and decisions do their full work every step.
    rows = [time_decisions(policy, b, repeats=args.repeats, speculating=spec)
            for spec in (False, True) for b in args.batch]
    # wall time, then the thread's CPU time (what the controller itself costs on a busy machine)
    print(f"{'batch':>6} {'classes':>12} {'mean K':>7} {'median_us':>10} {'p99_us':>10}"
          f" {'cpu_median_us':>14} {'cpu_p99_us':>11}")
    for r in rows:
        print(f"{r['batch']:>6} {'speculating' if r['speculating'] else 'all':>12}"
              f" {r['mean_k']:>7.2f} {r['median_us']:>10.1f} {r['p99_us']:>10.1f}"
              f" {r['cpu_median_us']:>14.1f} {r['cpu_p99_us']:>11.1f}")
    _write_json(args.json, {"decision_time": rows, "policy": str(args.policy)})
    return 0


def cmd_bench_run(args: argparse.Namespace) -> int:
    from adaptspec.tools.bench.run import run

    return run(args)


def cmd_bench_nopay(args: argparse.Namespace) -> int:
    from adaptspec.tools.bench.nopay import run

    return run(args)


def cmd_bench_unseen(args: argparse.Namespace) -> int:
    from adaptspec.tools.bench.unseen import run

    return run(args)


def cmd_bench_vllm_client(args: argparse.Namespace) -> int:
    from adaptspec.tools.bench.vllm_client import run

    return run(args)


def cmd_bench_calibrate(args: argparse.Namespace) -> int:
    from adaptspec.tools.bench.calibrate import main as calibrate_main

    return calibrate_main(args)


def cmd_models(args: argparse.Namespace) -> int:
    from adaptspec.tools import models

    if args.which == "tiny":
        info = models.build_tiny(Path(args.out) if args.out else None)
    else:
        info = models.build_qwen(Path(args.out) if args.out else None,
                                 roles=tuple(args.roles))
    print(json.dumps(info, indent=2, default=str))
    return 0


def cmd_dashboard_snapshot(args: argparse.Namespace) -> int:
    from adaptspec.tools.dashboard import snapshot_main

    return snapshot_main(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from adaptspec.tools.demo import run_demo

    return run_demo(args)


def _bench_command(sub: Any, name: str, module: str, func: Any, help: str) -> None:
    """A `bench` subcommand whose module brings its own arguments (its add_arguments)."""
    p = sub.add_parser(name, help=help)
    importlib.import_module(module).add_arguments(p)
    p.set_defaults(func=func)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="adaptspec", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    pol = sub.add_parser("policy", help="policy tools")
    pol_sub = pol.add_subparsers(dest="policy_command", required=True)
    chk = pol_sub.add_parser("check", help="validate a policy and print it resolved")
    chk.add_argument("file")
    chk.set_defaults(func=cmd_policy_check)

    sim = sub.add_parser("simulate", help="simulate none vs static K vs adaptive vs oracle")
    sim.add_argument("--policy", default="default")
    sim.add_argument("--workload", default="mixed",
                     choices=["mixed", "code", "creative", "ngram"])
    sim.add_argument("--preset", choices=["cpu", "gpu"], default=None,
                     help="step-time model of the simulated engine (default: the policy's)")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--quick", action="store_true", help="fewer loads and requests")
    sim.add_argument("--lag", type=int, default=None,
                     help="feed the controller by request id, as the plugin does, each step's "
                          "feedback this many steps late beyond the next step (vLLM's async "
                          "scheduling: 1)")
    sim.add_argument("--prior-check", action="store_true",
                     help="instead: the gpu preset as prior over a true curve 20-30%% cheaper "
                          "at large batch; steps until the controller finds the K that pays")
    sim.add_argument("--seeds", type=int, default=10, help="seeds per cell of --prior-check")
    sim.add_argument("--json", default=None, help="write the result here")
    sim.set_defaults(func=cmd_simulate)

    bench = sub.add_parser(
        "bench", help="benchmarks: `bench [run] [--quick]` (real vLLM servers: none vs static K "
                   "vs adaptspec), `bench decide` (controller time per step)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    brun = bench_sub.add_parser("run", help="none vs vLLM static K vs adaptspec, real servers")
    from adaptspec.tools.bench.run import add_arguments as add_bench_arguments

    add_bench_arguments(brun)
    brun.set_defaults(func=cmd_bench_run)
    dec = bench_sub.add_parser("decide", help="controller decision time per step")
    dec.add_argument("--policy", default="default")
    dec.add_argument("--preset", choices=["cpu", "gpu"], default="gpu")
    dec.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    dec.add_argument("--repeats", type=int, default=5000)
    dec.add_argument("--json", default=None)
    dec.set_defaults(func=cmd_bench_decide)
    _bench_command(bench_sub, "nopay", "adaptspec.tools.bench.nopay", cmd_bench_nopay,
                   "the cell where speculation does not pay: default model, chat at c=4 "
                   "plus a latency-critical stream; plain (async and sync) vs vLLM ngram K=4 "
                   "vs adaptspec, repeated")
    _bench_command(bench_sub, "unseen", "adaptspec.tools.bench.unseen", cmd_bench_unseen,
                   "chat the project never tuned on (its unseen prompt set), default model "
                   "at c=4, with and without a latency-critical stream: plain vs vLLM ngram "
                   "K=2/4/8 vs adaptspec over vLLM's ngram and over its own, repeated")
    _bench_command(bench_sub, "vllm-client", "adaptspec.tools.bench.vllm_client",
                   cmd_bench_vllm_client,
                   "the unseen long chat prompts through vLLM's own benchmark client "
                   "(vllm bench serve), a fresh server per configuration and repeat: "
                   "plain vs vLLM ngram K=2/4/8 vs adaptspec")
    _bench_command(bench_sub, "trace", "adaptspec.tools.bench.trace", cmd_bench_trace,
                   "a day of traffic: one server per configuration through phases of 1, 4, "
                   "16, 4 and 1 users, code then chat and math then writing, a "
                   "latency-critical stream throughout")
    _bench_command(bench_sub, "queues", "adaptspec.tools.bench.queues", cmd_bench_queues,
                   "separate queues: DP=2 with latency-critical requests on an engine of "
                   "their own vs DP=2 shared vs plain DP=2, one mixed stream")
    _bench_command(bench_sub, "calibrate", "adaptspec.tools.bench.calibrate",
                   cmd_bench_calibrate,
                   "fit the simulator's cpu step-time preset to a bench.json and check "
                   "its predicted ratios against the measured ones")

    sub.add_parser("serve", help="vLLM's OpenAI server with adaptspec on (see `serve -h`)")

    demo = sub.add_parser("demo", help="the main job: plain vLLM vs adaptspec, side by side")
    from adaptspec.tools.demo import add_arguments as add_demo_arguments

    add_demo_arguments(demo)
    demo.set_defaults(func=cmd_demo)

    snap = sub.add_parser("dashboard-snapshot",
                          help="render the key Grafana panels to PNG from a Prometheus")
    from adaptspec.tools.dashboard import add_snapshot_arguments

    add_snapshot_arguments(snap)
    snap.set_defaults(func=cmd_dashboard_snapshot)

    mod = sub.add_parser("models", help="build the test model pair or fetch the Qwen pair; "
                                        "`models self-draft -h`: a draft from the target's "
                                        "first layers; `models eagle -h`: an EAGLE head")
    mod.add_argument("which", choices=["tiny", "qwen"])
    mod.add_argument("--out", default=None, help="output folder (default: ~/.cache/adaptspec)")
    mod.add_argument("--roles", nargs="+", choices=["draft", "target"],
                     default=["draft", "target"],
                     help="qwen only: which of the pair (draft: the 0.5B, target: the 1.5B)")
    mod.set_defaults(func=cmd_models)

    state = sub.add_parser("state", help="learned-state snapshots")
    state_sub = state.add_subparsers(dest="state_command", required=True)
    merge = state_sub.add_parser(
        "merge", help="one snapshot from several engines' (data-parallel ranks, replicas), "
        "e.g. a new replica's warm_start")
    merge.add_argument("files", nargs="+", help="state files")
    merge.add_argument("--out", required=True, help="the merged snapshot to write")
    merge.set_defaults(func=cmd_state_merge)
    return ap


def cmd_state_merge(args: argparse.Namespace) -> int:
    from adaptspec import snapshot

    try:
        merged = snapshot.merge([snapshot.read(f) for f in args.files])
    except (snapshot.SnapshotError, OSError) as e:
        print(f"adaptspec state merge: {e}", file=sys.stderr)
        return 2
    snapshot.write(merged, args.out)
    print(f"merged {len(args.files)} snapshots ({merged['steps']} steps, "
          f"{sum(len(c) for c in merged['proposers'].values())} proposer-class rows) into "
          f"{args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        # Everything after `serve` belongs to vLLM, so argparse must not see it.
        from adaptspec.serve import serve

        return serve(argv[1:])
    if argv[:2] in (["models", "self-draft"], ["models", "eagle"]):
        from adaptspec.tools.models import main as models_main

        return models_main(argv[1:], prog="adaptspec models")
    if argv[:1] == ["bench"] and argv[1:2] not in (["run"], ["decide"], ["calibrate"],
                                                  ["nopay"], ["unseen"], ["vllm-client"],
                                                  ["trace"], ["queues"], ["-h"], ["--help"]):
        argv = ["bench", "run", *argv[1:]]  # `adaptspec bench --quick` runs the benchmark
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except PolicyError as e:
        print(f"adaptspec: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
