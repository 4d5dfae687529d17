"""An EAGLE-1 head for a target, trained here by self-distillation: what vLLM's `eagle` runs.

``adaptspec models eagle TARGET --out DIR`` writes the Llama form vLLM loads as
``EagleLlamaForCausalLM`` (``vllm/model_executor/models/llama_eagle.py``): ``fc`` [H, 2H] and one
decoder layer without an input layernorm; no embedding or lm_head, so vLLM shares the target's.
At position t the head reads the target's next token's embedding and the target's final hidden
state at t (after its final norm, what feeds its lm_head), ``fc(cat(embed(x[t+1]), h[t]))``, and
its output stands for ``h[t+1]``: the target's lm_head on it drafts ``x[t+2]``; fed back with that
token, the next.

Data: the prompts of ``adaptspec/tools/bench/prompts/trace.json`` (code, roleplay, math,
writing; the tokenizer's chat template where it has one), each continued greedily by the target
itself, so no outside dataset is needed. The last ``HELD_OUT`` prompts of each kind are held out
and measure the head: per kind, the greedy acceptance of draft position j given the positions
before it were accepted (drafting as vLLM does, from the head's own outputs).

Training: teacher-forced over whole sequences, the loss of EAGLE-1 (Li et al., 2024): smooth-L1
between the head's output and ``h[t+1]`` plus 0.1 x the cross-entropy of the target's lm_head
on it against the target's own next token. Adam, fixed steps, sequences in a fixed order, a
fixed seed and threads with deterministic algorithms: two builds with the same inputs and
library versions are byte-identical. ``DIR/eagle.json`` is the manifest: data, steps, loss,
acceptance, the target's weights' sha256. Written to a hidden sibling folder and renamed into
place, as the self-draft is.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaptspec.tools.models.cache import sha256_file
from adaptspec.tools.models.selfdraft import (
    COPIED_FILES,
    Progress,
    SelfDraftError,
    inspect_target,
    install,
    load_target,
    torch_threads,
)

EAGLE_VERSION = 1
MANIFEST = "eagle.json"
HELD_OUT = 2  # prompts per kind kept for the acceptance measurement
GEN_TOKENS = 96
GEN_BATCH = 8  # prompts continued together
STEPS = 600
LR = 1e-3
CE_WEIGHT = 0.1  # EAGLE-1's weight of the token loss against the feature regression
GRAD_CLIP = 0.5  # EAGLE-1's gradient-norm clip: without it a build of the 0.5B's head diverged
EVAL_K = 4
EVAL_EVERY = 8  # measure drafting from every 8th generated position


class EagleError(SelfDraftError):
    """An EAGLE head that cannot be built from these inputs; the message says why."""


@dataclass
class EagleResult:
    path: Path
    report: dict[str, Any]


def head_config(target: dict[str, Any]) -> dict[str, Any]:
    """The head's config.json: the target's shapes, in the Llama form with one layer."""
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "rms_norm_eps", "vocab_size", "max_position_embeddings", "hidden_act",
            "rope_parameters", "rope_theta", "rope_scaling", "bos_token_id", "eos_token_id")
    cfg = {k: target[k] for k in keys if k in target}
    cfg["head_dim"] = target.get("head_dim") or target["hidden_size"] // \
        target["num_attention_heads"]
    cfg.update(architectures=["EagleLlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
               attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
               torch_dtype="float32")
    return cfg


def _head_module(cfg: dict[str, Any]) -> Any:
    import torch
    from torch import nn
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    config._attn_implementation = "sdpa"  # causal without a mask

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            h = config.hidden_size
            self.fc = nn.Linear(2 * h, h, bias=False)
            self.layer = LlamaDecoderLayer(config, layer_idx=0)
            self.layer.input_layernorm = nn.Identity()  # as vLLM's EAGLE layer 0
            self.rotary = LlamaRotaryEmbedding(config)

        def forward(self, emb: torch.Tensor, hid: torch.Tensor) -> torch.Tensor:
            x = self.fc(torch.cat((emb, hid), dim=-1))
            pos = torch.arange(x.shape[1]).unsqueeze(0)
            return self.layer(x, position_ids=pos, position_embeddings=self.rotary(x, pos))

        def state(self) -> dict[str, torch.Tensor]:
            """The weights under the names vLLM's EagleLlamaForCausalLM loads."""
            out = {"fc.weight": self.fc.weight}
            for k, v in self.layer.state_dict().items():
                if not k.startswith("input_layernorm"):
                    out[f"layers.0.{k}"] = v
            return {k: v.detach().contiguous() for k, v in sorted(out.items())}

    return Head()


def training_prompts(tokenizer: Any) -> dict[str, list[list[int]]]:
    """The trace set's prompts by kind, as token ids (chat template where the tokenizer has
    one)."""
    from adaptspec.tools.bench.prompts import load_trace

    data = load_trace()
    out: dict[str, list[list[int]]] = {}
    for kind in ("code", "roleplay", "math", "writing"):
        ids = []
        for p in data[kind]:
            if getattr(tokenizer, "chat_template", None):
                ids.append(list(tokenizer.apply_chat_template(
                    [{"role": "user", "content": p["prompt"]}], add_generation_prompt=True,
                    tokenize=True, return_dict=False)))
            else:
                ids.append(tokenizer(p["prompt"])["input_ids"])
        out[kind] = ids
    return out


def self_distill(model: Any, prompts: list[list[int]], gen_tokens: int, batch: int = GEN_BATCH
                 ) -> list[tuple[Any, Any, int]]:
    """Each prompt continued greedily by the target: (token ids [T], final hidden states
    [T, H], prompt length). Prompts go `batch` at a time, in their order, left-padded: on CPU a
    decode step reads all the weights whatever the batch, so one prompt at a time spent most
    of a build here. A continuation ends at its first end-of-sequence token (kept), as a
    one-prompt `generate` ends; the hidden states are the target's over the unpadded
    sequence."""
    import torch

    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    pad = min(eos)
    out = []
    with torch.no_grad():
        for start in range(0, len(prompts), batch):
            group = prompts[start:start + batch]
            width = max(len(p) for p in group)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=gen_tokens,
                                 do_sample=False, pad_token_id=pad)[:, width:]
            for p, g in zip(group, gen.tolist(), strict=True):
                end = next((i + 1 for i, t in enumerate(g) if t in eos), len(g))
                seq = torch.tensor(p + g[:end])
                hid = model.model(input_ids=seq.unsqueeze(0)).last_hidden_state[0]
                out.append((seq, hid, len(p)))
    return out


def _labels(lm_head: Any, hid: Any) -> Any:
    """The target's own next token at each position of a sequence, from its hidden states."""
    import torch

    with torch.no_grad():
        return (hid[1:] @ lm_head.T).argmax(-1)


def _loss(head: Any, embed: Any, lm_head: Any, seq: Any, hid: Any, label: Any) -> Any:
    import torch.nn.functional as F  # noqa: N812

    o = head(embed(seq[1:]).unsqueeze(0), hid[:-1].unsqueeze(0))[0]  # stands for hid[1:]
    return F.smooth_l1_loss(o, hid[1:]) + CE_WEIGHT * F.cross_entropy(o @ lm_head.T, label)


def acceptance(head: Any, embed: Any, lm_head: Any, data: list[tuple[Any, Any, int]],
               k: int = EVAL_K) -> list[dict[str, int]]:
    """Greedy drafting as vLLM's eagle does it, from every EVAL_EVERY-th generated position:
    per draft position j, how many drafts reached it and how many had it accepted (the
    target's own greedy continuation is the truth)."""
    import torch

    reached, accepted = [0] * k, [0] * k
    with torch.no_grad():
        for seq, hid, plen in data:
            for t in range(plen - 1, len(seq) - k - 1, EVAL_EVERY):
                toks, feats = seq[: t + 2].clone(), hid[: t + 1].clone()
                for j in range(k):
                    o = head(embed(toks[1:]).unsqueeze(0), feats.unsqueeze(0))[0, -1]
                    draft = int((o @ lm_head.T).argmax())
                    reached[j] += 1
                    if draft != int(seq[t + 2 + j]):
                        break
                    accepted[j] += 1
                    toks = torch.cat((toks, toks.new_tensor([draft])))
                    feats = torch.cat((feats, o.unsqueeze(0)))
    return [{"position": j + 1, "reached": r, "accepted": a}
            for j, (r, a) in enumerate(zip(reached, accepted, strict=True))]


def _recent(losses: list[float], n: int = 50) -> float:
    return sum(losses[-n:]) / len(losses[-n:])


def build_eagle(target: Path | str, out: Path | str, *, steps: int = STEPS,
                gen_tokens: int = GEN_TOKENS, seed: int = 0, threads: int = 2,
                force: bool = False, progress: Progress | None = None) -> EagleResult:
    """Train and write the head (see the module docstring)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    say = progress or (lambda _m: None)
    try:
        info = inspect_target(target)
    except SelfDraftError as e:
        raise EagleError(str(e).replace("self-draft knows", "eagle knows")) from None
    out = Path(out).expanduser().resolve()
    if out.exists() and not force:
        raise EagleError(f"{out} exists; pass --force to replace it")
    if steps < 1 or gen_tokens < EVAL_K + 2:
        raise EagleError(f"steps must be >= 1 and gen tokens >= {EVAL_K + 2}")
    with torch_threads(threads):
        torch.manual_seed(seed)
        tok = AutoTokenizer.from_pretrained(info.path)
        model = load_target(info.path)
        embed, lm_head = model.model.embed_tokens, model.lm_head.weight.detach()
        by_kind = training_prompts(tok)
        train, held = [], {}
        for kind, ids in by_kind.items():
            say(f"eagle: {kind}: {len(ids)} prompts continued by the target")
            seqs = self_distill(model, ids, gen_tokens)
            train += seqs[:-HELD_OUT]
            held[kind] = seqs[-HELD_OUT:]
        cfg = head_config(info.config)
        head = _head_module(cfg)
        opt = torch.optim.Adam(head.parameters(), lr=LR)
        # Each sequence's labels once, not at each of its ~steps/len(train) visits: they are a
        # third of a step's products with the lm_head (151,936 x 896 for Qwen2.5).
        labels = [_labels(lm_head, hid) for _, hid, _ in train]
        losses = []
        for step in range(steps):
            seq, hid, _ = train[step % len(train)]
            loss = _loss(head, embed, lm_head, seq, hid, labels[step % len(train)])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), GRAD_CLIP)
            opt.step()
            losses.append(float(loss.detach()))
            if not math.isfinite(losses[-1]):
                raise EagleError(f"training diverged at step {step + 1} (loss {losses[-1]})")
            if (step + 1) % max(steps // 10, 1) == 0:
                say(f"eagle: step {step + 1}/{steps}, loss {_recent(losses):.4f}")
        head.eval()
        acc = {kind: acceptance(head, embed, lm_head, seqs) for kind, seqs in held.items()}
        state = head.state()
    report = {
        "version": EAGLE_VERSION, "target": str(info.path),
        "target_sha256": {p.name: sha256_file(p) for p in info.weight_files},
        "data": {"source": "adaptspec/tools/bench/prompts/trace.json",
                 "train_prompts": len(train), "held_out_per_kind": HELD_OUT,
                 "gen_tokens": gen_tokens, "gen_batch": GEN_BATCH,
                 "train_tokens": sum(len(s) for s, _, _ in train)},
        "train": {"steps": steps, "seed": seed, "lr": LR, "ce_weight": CE_WEIGHT,
                  "grad_clip": GRAD_CLIP,
                  "threads": threads, "first_loss": round(losses[0], 6),
                  "final_loss": round(_recent(losses), 6)},
        "acceptance": acc,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for name in COPIED_FILES:
            if (info.path / name).is_file():
                shutil.copyfile(info.path / name, staging / name)
        report["head_sha256"] = sha256_file(staging / "model.safetensors")
        (staging / MANIFEST).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        for f in staging.iterdir():
            f.chmod(0o644)  # a server may run as another user
        install(staging, out, force)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return EagleResult(out, report)
