"""The tiny Llama pair, trained deterministically on the standard library's source."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from adaptspec.tools.models.cache import (
    TINY_VERSION,
    Progress,
    cached,
    default_dir,
    hash_tree,
    install_result,
    locked,
    require,
    with_paths,
    write_manifest,
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
    require("tokenizers")
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
    require("torch", "transformers", "tokenizers", "safetensors")
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

    with locked(out_dir):
        if not force and (hit := cached(out_dir, "tiny", TINY_VERSION, params, verify)):
            progress(f"tiny models: cached in {out_dir}")
            return with_paths(hit, out_dir)

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
            install_result(out_dir, staging, ("target", "draft"))

        manifest = {
            "builder": "tiny",
            "version": TINY_VERSION,
            "params": params,
            "files": hash_tree(out_dir, ("target", "draft")),
            "metrics": metrics,
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "tokenizers": importlib.metadata.version("tokenizers"),
            },
            "build_seconds": round(time.monotonic() - t_start, 2),
        }
        write_manifest(out_dir, manifest)
        progress(f"tiny models: done in {manifest['build_seconds']} s")
        return with_paths(manifest, out_dir)
