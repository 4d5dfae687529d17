"""Self-speculative drafts: a target's first N decoder layers with a fitted exit adapter.

``adaptspec models self-draft TARGET --layers N|auto --out DIR`` writes a Hugging Face folder
that vLLM loads as an ordinary ``draft_model``: the target's architecture class, its tokenizer
files, and weights made of the target's embedding, its first N decoder layers, its final norm
and an output head. The head is the target's head with a linear *exit adapter* folded in:

* Run the target (transformers, float32, CPU) over calibration text and collect, per position,
  ``x = norm(h_N)`` (the hidden state after layer N through the target's final norm) and ``y``,
  the target's final normalised hidden state (what feeds its ``lm_head``).
* Fit ``y ~ W x`` with scikit-learn's Ridge (no intercept), alpha from a small grid scored by
  next-token agreement with the target on a held-out slice of the calibration tokens.
* Save ``lm_head' = lm_head @ W``: the draft's logits are ``lm_head(W norm(h_N))``, and the
  draft stays a plain model (final norm kept, untied from the embedding).

Calibration text is the Python standard library's source, offline (``stdlib_split``), or a
text file of your own. ``DIR/selfdraft.json`` records agreement with and without the adapter on
held-apart stdlib files, alpha, token counts and the sha256 of the target's weights.
``--layers auto`` also times decoding for a few N on this machine and picks the best expected
speedup (``selfdraft_auto``). With an explicit N the same target, text, threads and library
versions give byte-identical files (deterministic algorithms, sorted keys, no timestamps);
``auto`` records timings and the N it picks may change with them, so it is not deterministic.
The output is written to a hidden sibling folder and renamed into place, so a failed build
never leaves a half-written model where a server would load it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaptspec.tools.models.cache import require, sha256_file
from adaptspec.tools.models.selfdraft_auto import choose_layers, default_candidates

SELFDRAFT_VERSION = 1
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
MIN_CALIBRATION_TOKENS = 1024
CALIBRATION_TOKENS = 8192  # fit + validation (the last 1/8 of the windows)
EVAL_TOKENS = 2048
WINDOW = 256  # tokens per calibration / evaluation sequence
STDLIB_BYTES = 3_000_000
PER_TEXT = 2  # windows per stdlib file at most, so that calibration spans many files
RIDGE_LAMBDAS = (1.0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5)  # alpha = lambda * trace(X'X) / hidden
THREADS = 2
REPORT = "selfdraft.json"
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                "chat_template.jinja", "chat_template.json", "generation_config.json")

Progress = Callable[[str], Any]


class SelfDraftError(ValueError):
    """A self-draft that cannot be built from these inputs; the message says why."""


@dataclass
class TargetInfo:
    path: Path
    config: dict[str, Any]
    architecture: str
    layers: int
    weight_files: list[Path]


@dataclass
class SelfDraftResult:
    path: Path
    layers: int
    report: dict[str, Any]
    adapter: Any = field(repr=False)  # torch float32 [hidden, hidden]: y ~ adapter @ x


def inspect_target(target: Path | str) -> TargetInfo:
    """The target folder's config, checked: a known architecture and safetensors weights."""
    path = Path(target).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise SelfDraftError(f"{target}: not a model folder (no config.json)")
    try:
        config = json.loads((path / "config.json").read_text())
        archs = config.get("architectures") or []
        layers = int(config["num_hidden_layers"]) if archs else 0
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SelfDraftError(f"{target}: unreadable config.json ({type(e).__name__}: {e})"
                             ) from None
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise SelfDraftError(f"{target}: architecture {archs or 'unknown'} is not supported; "
                             f"self-draft knows {', '.join(SUPPORTED_ARCHITECTURES)}")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise SelfDraftError(f"{target}: no *.safetensors weights in the folder")
    return TargetInfo(path, config, archs[0], layers, weights)


def check_layers(info: TargetInfo, layers: int) -> None:
    if not 1 <= layers <= info.layers - 1:
        raise SelfDraftError(f"--layers {layers} is out of range: the target has {info.layers} "
                             f"layers, so N must be 1..{info.layers - 1}")


@functools.lru_cache(maxsize=1)
def stdlib_split(budget: int = STDLIB_BYTES) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(calibration, evaluation) texts: the stdlib's ``.py`` files in sorted order, duplicates
    dropped, every 4th file (index 3, 7, ...) held apart for evaluation."""
    from adaptspec.tools.models.tiny import stdlib_corpus

    texts = list(dict.fromkeys(stdlib_corpus(budget)))  # a few files are copies of others
    return (tuple(t for i, t in enumerate(texts) if i % 4 != 3),
            tuple(t for i, t in enumerate(texts) if i % 4 == 3))


def token_windows(tokenizer: Any, texts: Sequence[str], max_tokens: int, window: int = WINDOW,
                  per_text: int | None = PER_TEXT) -> Any:
    """Up to ``max_tokens`` tokens of ``texts`` as ``[n, window]`` rows, each led by BOS where
    the tokenizer adds one by default. At most ``per_text`` windows come from one text, evenly
    spaced through it (None: all of it, back to back), so that they span many files. An empty
    ``[0, window]`` tensor if there is too little text."""
    import torch

    probe = tokenizer("x")["input_ids"]
    bos = probe[0] if len(probe) > len(tokenizer("x", add_special_tokens=False)["input_ids"]) \
        else None
    width = window - (bos is not None)
    rows: list[list[int]] = []
    for text in texts:
        if len(rows) >= max_tokens // window:
            break
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        k = len(ids) // width if per_text is None else min(per_text, len(ids) // width)
        starts = [i * width for i in range(k)] if per_text is None else \
            [i * (len(ids) - width) // max(k - 1, 1) for i in range(k)]
        rows.extend(([bos] if bos is not None else []) + ids[s:s + width] for s in starts)
    rows = rows[: max_tokens // window]
    return torch.tensor(rows, dtype=torch.long).reshape(len(rows), window)


@contextlib.contextmanager
def torch_threads(threads: int = THREADS) -> Iterator[None]:
    """Fixed threads and deterministic algorithms (the float arithmetic then repeats)."""
    import torch

    old = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(old[0])
        torch.use_deterministic_algorithms(old[1])


def load_target(path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def collect_states(model: Any, windows: Any, layers: list[int], batch: int = 2
                   ) -> tuple[dict[int, Any], Any, Any]:
    """``({N: norm(h_N)}, final normalised hidden state, target argmax)``, one row per
    position of ``windows`` (float32, ``[positions, hidden]``)."""
    import torch

    xs: dict[int, list[Any]] = {n: [] for n in layers}
    ys, preds = [], []
    base, norm = model.model, model.model.norm
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            out = base(input_ids=windows[i:i + batch], output_hidden_states=True)
            hs = out.hidden_states
            for n in layers:
                xs[n].append(norm(hs[n]).flatten(0, 1))
            y = out.last_hidden_state.flatten(0, 1)  # after the final norm: feeds lm_head
            ys.append(y)
            preds.append(head_argmax(model.lm_head.weight, y))
    return {n: torch.cat(v) for n, v in xs.items()}, torch.cat(ys), torch.cat(preds)


def head_argmax(head: Any, x: Any, adapter: Any = None, chunk: int = 256) -> Any:
    """argmax of ``head @ (adapter @ x)`` per row of ``x``, in chunks (vocabularies are big)."""
    import torch

    with torch.no_grad():
        if adapter is not None:
            x = x @ adapter.T
        return torch.cat([(x[i:i + chunk] @ head.T).argmax(-1) for i in range(0, len(x), chunk)])


def agreement(head: Any, x: Any, target_pred: Any, adapter: Any = None) -> float:
    """Fraction of positions whose argmax next token equals the target's."""
    return float((head_argmax(head, x, adapter) == target_pred).double().mean())


def fit_adapter(x: Any, y: Any, head: Any, target_pred: Any, n_val: int,
                lambdas: tuple[float, ...] = RIDGE_LAMBDAS) -> tuple[Any, dict[str, Any]]:
    """Ridge ``y ~ W x`` on all but the last ``n_val`` rows; alpha by agreement on those (ties:
    the larger alpha). Returns ``(W float32 [hidden, hidden], info)``."""
    import numpy as np
    import torch
    from sklearn.linear_model import Ridge
    from threadpoolctl import threadpool_limits

    xf, yf = x[:-n_val].double().numpy(), y[:-n_val].double().numpy()
    scale = float(np.einsum("ij,ij->", xf, xf)) / xf.shape[1]
    best: tuple[float, Any, float] | None = None
    scores: dict[str, float] = {}
    for lam in lambdas:
        with threadpool_limits(torch.get_num_threads()):  # BLAS threads as torch's
            ridge = Ridge(alpha=lam * scale, fit_intercept=False, solver="cholesky").fit(xf, yf)
        w = torch.from_numpy(np.ascontiguousarray(ridge.coef_)).float()
        score = agreement(head, x[-n_val:], target_pred[-n_val:], w)
        scores[f"{lam:g}"] = round(score, 4)
        if best is None or score > best[2]:
            best = (lam, w, score)
    assert best is not None
    return best[1], {"lambda": best[0], "alpha": round(best[0] * scale, 6),
                     "validation_agreement": scores}


def write_draft(info: TargetInfo, layers: int, adapter: Any, head: Any, folder: Path) -> None:
    """The draft model's files (weights, config, tokenizer) into ``folder``: the target's
    tensors but layers >= N, and ``head @ adapter`` (``head``: the loaded target's lm_head,
    tied or not) as lm_head, in the embedding's dtype."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    keep: dict[str, Any] = {}
    for wf in info.weight_files:
        with safe_open(str(wf), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                parts = key.split(".")
                if key.startswith("model.layers.") and int(parts[2]) >= layers:
                    continue
                keep[key] = f.get_tensor(key)
    dtype = keep["model.embed_tokens.weight"].dtype
    with torch.no_grad():
        keep["lm_head.weight"] = (head.float() @ adapter.float()).to(dtype).contiguous()
    save_file({k: keep[k].contiguous() for k in sorted(keep)}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    config = dict(info.config)
    config["num_hidden_layers"] = layers
    config["tie_word_embeddings"] = False
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:layers]
    if isinstance(config.get("max_window_layers"), int):
        config["max_window_layers"] = min(config["max_window_layers"], layers)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in COPIED_FILES:
        if (info.path / name).is_file():
            shutil.copyfile(info.path / name, folder / name)


def install(staging: Path, out: Path, force: bool) -> None:
    """Rename ``staging`` to ``out``; an existing ``out`` is replaced only with ``force``."""
    os.chmod(staging, 0o755)
    if out.exists():
        if not force:
            raise SelfDraftError(f"{out} exists; pass --force to replace it")
        trash = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
        os.replace(out, trash / "old")
        os.replace(staging, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, out)


def calibration_windows(tokenizer: Any, text: str | None, tokens: int
                        ) -> tuple[Any, dict[str, Any]]:
    """``tokens`` tokens of ``text`` (default: the stdlib's calibration files) as windows."""
    if tokens < MIN_CALIBRATION_TOKENS:
        raise SelfDraftError(f"--calibration-tokens {tokens} is below the minimum of "
                             f"{MIN_CALIBRATION_TOKENS}")
    own = text is not None
    texts = [text] if text is not None else list(stdlib_split()[0])
    windows = token_windows(tokenizer, texts, tokens, per_text=None if own else PER_TEXT)
    n = windows.numel()
    if n < MIN_CALIBRATION_TOKENS:
        raise SelfDraftError(f"calibration text too short: {n} tokens in whole {WINDOW}-token "
                             f"windows, at least {MIN_CALIBRATION_TOKENS} needed")
    sha = hashlib.sha256("\0".join(texts).encode()).hexdigest()
    return windows, {"source": "file" if own else "stdlib", "sha256": sha}


def build_self_draft(
    target: Path | str,
    out: Path | str,
    layers: int | str,
    *,
    force: bool = False,
    calibration_text: str | None = None,
    calibration_tokens: int = CALIBRATION_TOKENS,
    eval_tokens: int = EVAL_TOKENS,
    k: int = 2,
    candidates: list[int] | None = None,
    threads: int = THREADS,
    progress: Progress = print,
) -> SelfDraftResult:
    """Build the self-draft of ``target`` with ``layers`` (an int, or ``"auto"``) into ``out``.

    ``calibration_text`` replaces the stdlib calibration files (the evaluation text stays the
    stdlib's held-apart files). With ``"auto"``, ``candidates`` (default: a few N spread over
    1..L-1) are timed and scored; ``k`` is the draft length the expected speedup assumes.
    ``threads`` (torch's, fixed for the build) is part of the inputs: the float arithmetic,
    hence the bytes, may differ with another count.
    Raises :class:`SelfDraftError` for inputs it cannot use, before any heavy work.
    """
    require("torch", "transformers", "safetensors")
    require("sklearn")  # scikit-learn: in the models extra (and bench, dev)
    info = inspect_target(target)
    auto = layers == "auto"
    if not auto:
        if isinstance(layers, str) and not layers.isdigit():
            raise SelfDraftError(f"--layers must be a number or 'auto', not {layers!r}")
        layers = int(layers)
        check_layers(info, layers)
    cands = sorted(set(candidates or default_candidates(info.layers))) if auto else [layers]
    for n in cands:
        check_layers(info, n)
    out = Path(out).expanduser().resolve()
    if out == info.path:
        raise SelfDraftError("--out must not be the target folder")
    if out.exists() and not force:
        raise SelfDraftError(f"{out} exists; pass --force to replace it")

    import sklearn
    import torch
    import transformers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(info.path)
    calib, calib_info = calibration_windows(tokenizer, calibration_text, calibration_tokens)
    evals = token_windows(tokenizer, stdlib_split()[1], eval_tokens)
    n_val = max(1, len(calib) // 8) * WINDOW
    report: dict[str, Any] = {
        "builder": "self-draft", "version": SELFDRAFT_VERSION, "target": str(info.path),
        "architecture": info.architecture, "target_layers": info.layers,
        "target_sha256": {p.name: sha256_file(p) for p in info.weight_files},
        "calibration": {**calib_info, "window": WINDOW, "fit_tokens": calib.numel() - n_val,
                        "validation_tokens": n_val, "eval_tokens": evals.numel(),
                        "threads": threads,
                        "eval_source": "stdlib (every 4th file, held apart)"},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "scikit-learn": sklearn.__version__},
    }
    progress(f"self-draft: {info.architecture}, {info.layers} layers; calibrating N in {cands} "
             f"on {calib.numel()} tokens")
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch_threads(threads):
        model = load_target(info.path)
        head = model.lm_head.weight.detach()
        x, y, pred = collect_states(model, calib, cands)
        ex, _, epred = collect_states(model, evals, cands)
        per_n: dict[int, dict[str, Any]] = {}
        adapters = {}
        for n in cands:
            adapters[n], fit = fit_adapter(x[n], y, head, pred, n_val)
            per_n[n] = {
                **fit,
                "validation_agreement_with_adapter": max(fit["validation_agreement"].values()),
                "validation_agreement_plain": round(
                    agreement(head, x[n][-n_val:], pred[-n_val:]), 4),
                "eval_agreement_with_adapter": round(agreement(head, ex[n], epred, adapters[n]), 4),
                "eval_agreement_without_adapter": round(agreement(head, ex[n], epred), 4)}
            progress(f"  N={n}: agreement on held-apart text "
                     f"{per_n[n]['eval_agreement_with_adapter']} with the adapter, "
                     f"{per_n[n]['eval_agreement_without_adapter']} without")
        if auto:
            layers, report["auto"] = choose_layers(model, per_n, k, progress)
        del model, x, y, ex
    assert isinstance(layers, int)
    report["layers"] = layers
    report["mode"] = "auto" if auto else "explicit"
    report["adapter"] = {key: per_n[layers][key] for key in ("lambda", "alpha",
                                                             "validation_agreement")}
    report["agreement"] = {key[len("eval_agreement_"):]: per_n[layers][key]
                           for key in per_n[layers] if key.startswith("eval_agreement_")}
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.build-"))
    try:
        write_draft(info, layers, adapters[layers], head, staging)
        (staging / REPORT).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        install(staging, out, force)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    progress(f"self-draft: N={layers} written to {out}")
    return SelfDraftResult(out, layers, report, adapters[layers])
