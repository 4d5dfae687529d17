"""adaptspec.tools.models: the tiny pair's builder (determinism, cache, contents, agreement) and the
Qwen pair's helpers. The tiny pair itself comes from the session fixture ``tiny_models``
(tests/conftest.py); the Qwen pair is only checked when it is already built."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

for _mod in ("torch", "transformers", "tokenizers", "safetensors"):
    pytest.importorskip(_mod, reason="needs the models extra: pip install 'adaptspec[models]'")

from adaptspec.tools import models  # noqa: E402

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
CODE = '''def parse(text, sep=","):
    """Split ``text`` on ``sep`` and strip each field."""
    fields = []
    for item in text.split(sep):
        fields.append(item.strip())
    return fields
'''


def _quiet(_msg: str) -> None:
    pass


class _Rebuilt(Exception):
    pass


def _no_rebuild(*_args: Any, **_kwargs: Any) -> Any:
    raise _Rebuilt


# ------------------------------------------------------------------------------------------
# building and caching


def test_tiny_build_is_deterministic_and_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    a = models.build_tiny(tmp_path / "a", train_steps=2, progress=_quiet)
    # the second build goes through the command line
    assert models.main(["tiny", "--out", str(tmp_path / "b"), "--train-steps", "2"]) == 0
    printed = capsys.readouterr().out
    assert "tiny models: building" in printed and "done in" in printed
    b = json.loads((tmp_path / "b" / models.MANIFEST).read_text())
    assert a["params"] == b["params"]
    assert a["files"] == b["files"]  # byte-identical weights and tokenizers
    assert {f"{role}/{name}" for role in ("target", "draft") for name in MODEL_FILES} <= set(
        a["files"]
    )
    assert a["target"] == str(tmp_path / "a" / "target")
    assert not list((tmp_path / "a").glob(".build-*"))  # staging folder cleaned up

    # a matching manifest is returned without rebuilding anything
    monkeypatch.setattr(models.tiny, "train_tokenizer", _no_rebuild)
    weights = tmp_path / "a" / "target" / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    msgs: list[str] = []
    again = models.build_tiny(tmp_path / "a", train_steps=2, progress=msgs.append)
    assert msgs == [f"tiny models: cached in {tmp_path / 'a'}"]
    assert again["files"] == a["files"] and weights.stat().st_mtime_ns == mtime

    # other parameters, a missing file or (with verify) changed bytes mean a rebuild
    with pytest.raises(_Rebuilt):
        models.build_tiny(tmp_path / "a", train_steps=3, progress=_quiet)
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    models.build_tiny(tmp_path / "a", train_steps=2, progress=_quiet)  # sizes still match
    with pytest.raises(_Rebuilt):
        models.build_tiny(tmp_path / "a", train_steps=2, verify=True, progress=_quiet)
    (tmp_path / "b" / "draft" / "tokenizer.json").unlink()
    with pytest.raises(_Rebuilt):
        models.build_tiny(tmp_path / "b", train_steps=2, progress=_quiet)


def test_cache_root_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    assert models.default_dir("tiny") == tmp_path / "tiny"
    monkeypatch.delenv(models.CACHE_ENV)
    assert models.default_dir("qwen") == Path("~/.cache/adaptspec/models/qwen").expanduser()


def test_negative_steps_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        models.build_tiny(tmp_path, train_steps=-1, progress=_quiet)


def test_stdlib_corpus_is_stable() -> None:
    a = models.stdlib_corpus(100_000)
    b = models.stdlib_corpus(100_000)
    assert a == b
    assert sum(len(t.encode()) for t in a) <= 100_000
    assert any("def " in t for t in a)


# ------------------------------------------------------------------------------------------
# the cached tiny pair


def test_tiny_folders(tiny_models: dict[str, Any]) -> None:
    from safetensors import safe_open

    root = Path(tiny_models["dir"])
    assert (root / models.MANIFEST).is_file()
    for role, layers in (("target", 4), ("draft", 1)):
        folder = Path(tiny_models[role])
        assert folder == root / role
        for name in MODEL_FILES:
            assert (folder / name).is_file(), f"{role}/{name}"
        config = json.loads((folder / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"]
        assert config["num_hidden_layers"] == layers
        assert config["vocab_size"] == models.TINY_VOCAB
        assert config["dtype"] == "float32"
        assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            n = 0
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                t = f.get_tensor(key)
                assert str(t.dtype) == "torch.float32", key
                n += t.numel()
        assert n == tiny_models["metrics"][f"{role}_params"]
        info = tiny_models["files"][f"{role}/model.safetensors"]
        assert info["bytes"] == (folder / "model.safetensors").stat().st_size
    assert 4.5e6 < tiny_models["metrics"]["target_params"] < 6e6
    assert 2e6 < tiny_models["metrics"]["draft_params"] < 3.5e6
    # one tokenizer for both
    files = tiny_models["files"]
    assert files["target/tokenizer.json"] == files["draft/tokenizer.json"]


def test_tokenizer_round_trips(tiny_models: dict[str, Any]) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_models["target"])
    raw = Tokenizer.from_file(str(Path(tiny_models["draft"]) / "tokenizer.json"))
    assert len(hf) == raw.get_vocab_size() == models.TINY_VOCAB
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 2)
    texts = [CODE, "x  =\t'tab'\r\n  # é ü 日本語 🙂\n\n", " leading space", ""]
    for text in texts:
        ids = hf(text).input_ids
        assert ids[0] == hf.bos_token_id  # <s> is added, nothing else
        assert ids.count(hf.bos_token_id) == 1 and hf.eos_token_id not in ids
        assert hf.decode(ids, skip_special_tokens=True) == text
        assert raw.encode(text).ids == ids
        assert raw.decode(ids) == text
    # BPE trained on Python source compresses Python source
    assert len(hf(CODE).input_ids) < len(CODE) / 3


def test_draft_agrees_with_target(tiny_models: dict[str, Any]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = tiny_models["metrics"]
    chance = 1 / models.TINY_VOCAB
    # recorded at build time on held-out stdlib text
    assert 0.3 < m["greedy_agreement"] < 0.99, m  # far above chance, but not the same model
    assert 0.3 < m["text_agreement"] < 0.99, m
    assert m["target_held_out_loss"] < 5.5  # below the corpus's unigram entropy (~6.4 nats)

    # and again from the saved folders, on prompts the builder never saw
    tok = AutoTokenizer.from_pretrained(tiny_models["target"])
    target = AutoModelForCausalLM.from_pretrained(tiny_models["target"]).eval()
    draft = AutoModelForCausalLM.from_pretrained(tiny_models["draft"]).eval()
    lines = [ln for ln in CODE.splitlines() if ln.strip()]
    prompts = [tok(ln).input_ids[:6] for ln in lines]
    prompts = torch.tensor([p for p in prompts if len(p) == 6])
    agreement = models.greedy_agreement(target, draft, prompts, new_tokens=16)
    assert agreement > 100 * chance, agreement


# ------------------------------------------------------------------------------------------
# Qwen helpers (no download)


def test_rope_theta_and_config_fix(tmp_path: Path) -> None:
    assert models.rope_theta_of({"rope_parameters": {"rope_theta": 1e6}}) == 1e6
    assert models.rope_theta_of({"rope_theta": 5e5}) == 5e5
    assert models.rope_theta_of({}) is None

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "qwen2", "quantization_config": {"x": 1}}))
    models.qwen._check_qwen_config(tmp_path)
    fixed = json.loads(cfg.read_text())
    assert "quantization_config" not in fixed
    assert fixed["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}

    good = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "a": 1}
    cfg.write_text(json.dumps(good))
    models.qwen._check_qwen_config(tmp_path)
    assert json.loads(cfg.read_text()) == good


def test_assemble_checks_sha256(tmp_path: Path) -> None:
    blobs = [b"abc" * 1000, b"", b"xyz" * 7]
    parts = []
    for i, blob in enumerate(blobs, 1):
        pkg = tmp_path / f"pkg_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(blob)
        parts.append(models.qwen._part_file(pkg, i))
    whole = b"".join(blobs)
    src = {"name": "fake", "sha256": hashlib.sha256(whole).hexdigest(), "bytes": len(whole)}
    out = tmp_path / "model.gguf"
    models.qwen._assemble(parts, out, src, _quiet)
    assert out.read_bytes() == whole
    with pytest.raises(RuntimeError, match="sha256"):
        models.qwen._assemble(parts[::-1], out, src, _quiet)
    with pytest.raises(RuntimeError, match="expected one"):
        models.qwen._part_file(tmp_path, 9)


def test_qwen_sources_are_pinned() -> None:
    for role, parts in (("draft", 6), ("target", 22)):
        src = models.QWEN_SOURCES[role]
        assert src["parts"] == parts
        assert len(src["sha256"]) == 64 and src["version"].count(".") == 2


def test_qwen_pair_if_built() -> None:
    """Checks the converted Qwen pair when it is in the cache (``adaptspec models qwen``)."""
    hit = models.cached_qwen()
    if hit is None:
        pytest.skip("the Qwen pair is not built (adaptspec models qwen)")
    files = hit["files"]
    assert files["draft/tokenizer.json"] == files["target/tokenizer.json"]
    for role, layers in (("draft", 24), ("target", 28)):
        config = json.loads((Path(hit[role]) / "config.json").read_text())
        assert config["model_type"] == "qwen2" and config["num_hidden_layers"] == layers
        assert config["vocab_size"] == 151_936
        assert models.rope_theta_of(config) == models.QWEN_ROPE_THETA
        assert "quantization_config" not in config
    assert not list(Path(hit["dir"]).glob(".build-*"))


def test_qwen_builds_only_the_roles_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo fetches the 0.5B alone; a later call for the pair builds only the 1.5B and keeps
    the 0.5B it has (no downloads here: the fetch and convert steps are stand-ins)."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    built: list[str] = []

    def fake_convert(gguf: Path, dst: Path, progress: Any) -> None:
        dst.mkdir()
        (dst / "config.json").write_text(json.dumps({"role": dst.name}))
        built.append(dst.name)

    monkeypatch.setattr(models.qwen, "_part_paths", lambda src, pip_dir, progress: [])
    monkeypatch.setattr(models.qwen, "_assemble", lambda parts, dst, src, progress: None)
    monkeypatch.setattr(models.qwen, "_convert_gguf", fake_convert)

    draft = models.build_qwen(tmp_path, roles=("draft",), progress=_quiet)
    assert built == ["draft"] and "target" not in draft
    assert models.cached_qwen(tmp_path) is None  # the pair is not there yet
    assert models.cached_qwen(tmp_path, roles=("draft",))["draft"] == str(tmp_path / "draft")

    again = models.build_qwen(tmp_path, roles=("draft",), progress=_quiet)
    assert built == ["draft"] and again["files"] == draft["files"]

    pair = models.build_qwen(tmp_path, progress=_quiet)
    assert built == ["draft", "target"]
    assert set(pair["params"]) == {"draft", "target", "dtype"}
    assert sorted(pair["files"]) == ["draft/config.json", "target/config.json"]
    assert models.cached_qwen(tmp_path)["target"] == str(tmp_path / "target")

    (tmp_path / "draft" / "config.json").write_text("changed")  # size differs: rebuilt
    models.build_qwen(tmp_path, roles=("draft",), progress=_quiet)
    assert built == ["draft", "target", "draft"]
    with pytest.raises(ValueError, match="roles"):
        models.build_qwen(tmp_path, roles=("huge",), progress=_quiet)
