"""The main job (`make serve`, `adaptspec demo`): the same requests against plain vLLM and vLLM
with adaptspec, side by side, and a table a person can read.

Both servers start at once (their logs go to files under --out); the request mix (code, chat and
a latency-critical `interactive` stream beside them) runs on plain vLLM, then on adaptspec. The
table gives tokens/s and their ratio, the latency-critical median inter-token gap, per class what
adaptspec did (mean K, acceptance, share of steps speculated), and whether every greedy output
was identical; the same goes to JSON. float32: in bfloat16 a step that verifies several tokens
rounds differently from one that decodes one, so greedy outputs could differ by rounding alone,
and the check would not test adaptspec.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from adaptspec.policy import SHIPPED, load_policy, shipped_policy
from adaptspec.serve import free_port
from adaptspec.tools.bench.cells import median_gap_ms, run_cell
from adaptspec.tools.bench.servers import OURS_NGRAM, Config, Server, Sizes
from adaptspec.tools.bench.workload import Request
from adaptspec.tools.promtext import difference, per_class

CODE_PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "import os\nimport sys\nimport json\n\ndef read_json(path):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(",
]
CHAT_PROMPTS = [
    "Tell me a short story about a lighthouse keeper.",
    "What is a good name for a cat?",
    "Describe the colour blue to someone who has never seen it.",
]
INTERACTIVE_PROMPTS = ["Say hello in three languages.", "Name three prime numbers."]
LC_CLASS = "interactive"
# Two plain servers on 2 shared cores differed by up to 6% between repeats (docs/nopay.md, "Where
# speculation does not pay"): a ratio inside this band is "about even".
NOISE = 0.03


def make_jobs(n_code: int, n_chat: int, n_lc: int, max_tokens: int, lc_tokens: int
              ) -> tuple[list[Request], list[Request]]:
    """The main stream (code and chat, interleaved) and the latency-critical one, greedy."""
    def job(rid: str, cls: str, prompt: str, n: int) -> Request:
        return Request(rid, cls, prompt, n, temperature=0.0, seed=0)

    code = [job(f"code-{i}", "code", CODE_PROMPTS[i % len(CODE_PROMPTS)], max_tokens)
            for i in range(n_code)]
    chat = [job(f"chat-{i}", "chat", CHAT_PROMPTS[i % len(CHAT_PROMPTS)], max_tokens)
            for i in range(n_chat)]
    main = [j for pair in zip(code, chat, strict=False) for j in pair]
    main += code[n_chat:] + chat[n_code:]
    lc = [job(f"lc-{i}", LC_CLASS, INTERACTIVE_PROMPTS[i % len(INTERACTIVE_PROMPTS)], lc_tokens)
          for i in range(n_lc)]
    return main, lc


def progress_bar(desc: str, total: int | None = None, unit: str = "it") -> tqdm:
    """A tqdm bar on stdout, sized from the terminal: a pseudo-terminal of size 0x0 (`script`,
    some CI runners) makes tqdm hide every bar."""
    cols, rows = shutil.get_terminal_size((100, 24))
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stdout,
                ncols=min(cols, 100) if cols > 0 else 100, nrows=rows if rows > 0 else 24)


def run_side(server: Server, main: list[Request], lc: list[Request], concurrency: int,
             bar: tqdm) -> dict[str, Any]:
    """The main stream at `concurrency` with the latency-critical requests sent one after
    another beside it (the first 2 s in); wall time is the main stream's."""
    warm_up = Request("warm-up", "code", CODE_PROMPTS[0], 8, temperature=0.0, seed=0)
    prompts = {r.id: r.prompt for r in [warm_up, *main, *lc]}
    cells = [run_cell(server, [warm_up], prompts, 1, "warm-up", tick=lambda: None)]
    before = server.metrics()

    def lc_stream() -> None:
        time.sleep(2.0)
        cells.append(run_cell(server, lc, prompts, 1, "latency-critical", tick=bar.update))

    lc_thread = threading.Thread(target=lc_stream, daemon=True)
    lc_thread.start()
    main_cell = run_cell(server, main, prompts, concurrency, "main", tick=bar.update)
    lc_thread.join()
    metrics = difference(server.metrics(), before)
    errors = [e for c in [main_cell, *cells] for e in c["errors"]]
    if errors or len(cells) < 2:
        raise RuntimeError(f"requests failed: {'; '.join(errors[:3]) or 'latency-critical'}")
    return {"wall_s": main_cell["wall_s"], "requests": main_cell["requests"],
            "lc_requests": cells[1]["requests"], "metrics": metrics}


def summarize(plain: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    def tok_s(side: dict[str, Any]) -> float:
        return sum(len(r["tokens"]) for r in side["requests"]) / side["wall_s"]

    reference = {r["id"]: r["tokens"] for r in plain["requests"] + plain["lc_requests"]}
    mine = {r["id"]: r["tokens"] for r in ours["requests"] + ours["lc_requests"]}
    classes = {}
    for cls, row in sorted(per_class(ours["metrics"]).items()):
        steps = sum(v for k, v in row.items() if k.startswith("steps_"))
        classes[cls] = {"mean_k": row["mean_k"], "acceptance": row["acceptance"],
                        "drafted": row.get("draft_tokens", 0.0),
                        "accepted": row.get("accepted_tokens", 0.0),
                        "steps": steps,
                        "speculated_share": row.get("steps_speculate", 0.0) / steps if steps
                        else 0.0}
    out = {
        "plain_tok_s": tok_s(plain), "adaptspec_tok_s": tok_s(ours),
        "ratio": tok_s(ours) / tok_s(plain),
        "lc_gap_ms": {"plain": median_gap_ms(plain["lc_requests"]),
                      "adaptspec": median_gap_ms(ours["lc_requests"])},
        "identical": sum(mine.get(k) == v for k, v in reference.items()),
        "compared": len(reference), "classes": classes,
        # The server's own account of its speculating steps against its plain ones (ms).
        "engine_saved_ms": _total(ours["metrics"], "adaptspec_payoff_saved_ms_total"),
        "engine_lost_ms": _total(ours["metrics"], "adaptspec_payoff_lost_ms_total"),
        "payoff_held_budget_steps": sum(
            v for labels, v in ours["metrics"].get("adaptspec_payoff_held_steps_total", {})
            .items() if dict(labels).get("reason") == "budget"),
    }
    out["lc_gap_ratio"] = out["lc_gap_ms"]["adaptspec"] / out["lc_gap_ms"]["plain"]
    out["explanation"] = explain(out)
    return out


def _total(metrics: dict[str, Any], name: str) -> float:
    return float(sum(metrics.get(name, {}).values()))


def explain(s: dict[str, Any]) -> str:
    """A few honest sentences from what was measured and what the controller did."""
    spec = {c: r for c, r in s["classes"].items() if r["drafted"]}
    did = "; ".join(f"{c}: {r['accepted']:.0f} of {r['drafted']:.0f} draft tokens accepted"
                    for c, r in spec.items())
    saved, lost = s.get("engine_saved_ms", 0.0), s.get("engine_lost_ms", 0.0)
    if did and (saved or lost):
        did += (f". By the server's own step times, its steps with drafts saved "
                f"{saved / 1000:.1f} s and lost {lost / 1000:.1f} s against plain steps of the "
                "same batch size")
    if s["ratio"] >= 1 + NOISE:
        return f"adaptspec was {s['ratio']:.2f}x plain decoding ({did or 'no drafts'})."
    even = s["ratio"] > 1 - NOISE
    head = (f"About even ({s['ratio']:.2f}x, within this machine's noise of +-{NOISE:.0%})"
            if even else f"adaptspec was slower here ({s['ratio']:.2f}x)")
    if not did:
        return (f"{head}. It verified no drafts (the controller priced speculation out, or the "
                "proposer found nothing to propose), so the difference is not speculation: "
                "adaptspec runs vLLM without async scheduling, which it needs, and the machine "
                "is noisy.")
    if even:
        return f"{head}: {did}."
    if s["payoff_held_budget_steps"]:
        why = (f"the payoff guard kept {s['payoff_held_budget_steps']:.0f} steps plain after "
               "speculation lost time")
    elif lost > saved:
        why = ("the steps that verified drafts cost more than the accepted tokens saved, and "
               "the controller had not yet priced them out")
    else:
        why = ("its steps with drafts paid, so the time went elsewhere: steps that also "
               "prefilled, the scheduling without async, or the machine's noise")
    return f"{head}: {did}; {why}."


def format_table(s: dict[str, Any]) -> str:
    lines = [
        f"{'':<30}{'plain vLLM':>12}{'adaptspec':>12}{'ratio':>9}",
        f"{'tokens/s':<30}{s['plain_tok_s']:>12.2f}{s['adaptspec_tok_s']:>12.2f}"
        f"{s['ratio']:>8.2f}x",
        f"{'latency-critical median ITL':<30}{s['lc_gap_ms']['plain']:>10.0f}ms"
        f"{s['lc_gap_ms']['adaptspec']:>10.0f}ms{s['lc_gap_ratio']:>8.2f}x",
        "",
        f"{'class':<14}{'mean K':>8}{'acceptance':>12}{'steps speculated':>18}",
    ]
    for cls, r in s["classes"].items():
        lines.append(f"{cls:<14}{r['mean_k']:>8.2f}{r['acceptance']:>12.2f}"
                     f"{r['speculated_share']:>18.0%}")
    same = "identical" if s["identical"] == s["compared"] else "NOT identical"
    lines += ["", f"greedy outputs: {s['identical']}/{s['compared']} {same} to plain vLLM's",
              "", s["explanation"]]
    return "\n".join(lines)


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Library warnings and prints of this process (fd 2) go to `path` while fetching."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "a") as f:
        os.dup2(f.fileno(), 2)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def _fetch_model(log: Path) -> str:
    from adaptspec.tools.models import build_qwen

    with progress_bar("fetching the model", unit=" step") as bar, \
            _stderr_to(log), open(log, "a") as f:
        def progress(msg: str) -> None:
            f.write(msg + "\n")
            f.flush()
            bar.set_postfix_str(msg.strip()[:40])
            bar.update()
        # The 0.5B alone: the demo's proposer is model-free; the benchmark fetches the pair.
        return str(build_qwen(roles=("draft",), progress=progress)["draft"])


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def run_demo(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = {"fetch": out / "fetch.log", "plain": out / "plain.log",
            "adaptspec": out / "adaptspec.log"}
    print(f"adaptspec demo: plain vLLM vs vLLM with adaptspec, side by side; logs in {out}/")
    policy_path = shipped_policy(args.policy) if args.policy in SHIPPED else \
        Path(args.policy).resolve()
    k_max = max(load_policy(str(policy_path)).k_max, 1)
    try:
        model = args.model or _fetch_model(logs["fetch"])
    except Exception as e:  # noqa: BLE001 - reported with the log, then the run fails
        print(f"fetching the model failed: {e}\n--- {logs['fetch']} (last lines) ---\n"
              f"{_tail(logs['fetch'])}")
        return 1
    sizes = Sizes(concurrency=(args.concurrency + 2,), requests={}, max_tokens=args.max_tokens,
                  interactive_tokens=args.lc_tokens, excerpt_chars=0, max_model_len=2048)
    configs = {"plain": Config("plain", None),
               "adaptspec": Config("adaptspec", {"method": "custom_class", "model": OURS_NGRAM,
                                                 "num_speculative_tokens": k_max},
                                   adaptive=True, family="ours")}
    main, lc = make_jobs(args.code, args.chat, args.lc, args.max_tokens, args.lc_tokens)
    servers: dict[str, Server] = {}
    sides: dict[str, dict[str, Any]] = {}
    current = "plain"
    try:
        with progress_bar("starting both servers", 2) as bar:
            for name, cfg in configs.items():
                port = args.port if name == "adaptspec" and args.keep else free_port()
                servers[name] = Server(cfg, model, port, sizes, policy_path, logs[name],
                                       dtype="float32", served_name="bench")
            for name, server in servers.items():
                current = name
                server.wait_ready()
                bar.update()
        for name, server in servers.items():
            current = name
            with progress_bar(f"requests to {name}", len(main) + len(lc), " req") as bar:
                sides[name] = run_side(server, main, lc, args.concurrency, bar)
    except Exception as e:  # noqa: BLE001 - reported with the log, then the run fails
        for s in servers.values():
            s.stop()
        print(f"\nthe {current} server failed: {e}\n--- {logs[current]} (last lines) ---\n"
              f"{_tail(logs[current])}")
        return 1
    summary = summarize(sides["plain"], sides["adaptspec"])
    print("\n" + format_table(summary))
    result = {"model": model, "policy": str(policy_path), "dtype": "float32",
              "concurrency": args.concurrency, "jobs": [j.asdict() for j in main + lc],
              "summary": summary,
              "sides": {k: {kk: vv for kk, vv in v.items() if kk != "metrics"}
                        for k, v in sides.items()}}
    (out / "demo.json").write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out / 'demo.json'}; server logs {logs['plain']}, {logs['adaptspec']}")
    servers["plain"].stop()
    if args.keep:
        _keep_serving(servers["adaptspec"])
    else:
        servers["adaptspec"].stop()
    return 0


def _keep_serving(server: Server) -> None:
    print(f"""
adaptspec keeps serving on {server.base} (Ctrl-C stops it). Try:
  curl {server.base}/v1/completions -H 'Content-Type: application/json' -d \\
    '{{"model": "bench", "prompt": "def fib(n):", "max_tokens": 32,
      "vllm_xargs": {{"adaptspec_class": "code"}}}}'
  curl -s {server.base}/metrics | grep ^adaptspec_
Dashboards: docs/metrics.md (examples/prometheus.yml scrapes this port, the Grafana JSON is
in examples/grafana).""")
    try:
        server.proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None,
                    help="model folder (default: Qwen2.5-Coder-0.5B-Instruct, fetched once)")
    ap.add_argument("--policy", default="default", help="a shipped policy's name or a YAML file")
    ap.add_argument("--code", type=int, default=8, help="code requests in the main stream")
    ap.add_argument("--chat", type=int, default=4, help="chat requests in the main stream")
    ap.add_argument("--lc", type=int, default=3,
                    help="latency-critical requests, one after another beside the main stream")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--lc-tokens", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--out", default="out/demo", help="logs and demo.json go here")
    ap.add_argument("--keep", action="store_true",
                    help="keep the adaptspec server up afterwards (on --port)")
    ap.add_argument("--port", type=int, default=8321, help="the kept server's port")
