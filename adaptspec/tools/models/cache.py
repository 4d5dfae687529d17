"""The model cache: folders under ~/.cache/adaptspec/models (ADAPTSPEC_MODELS_DIR), each with a
manifest.json written last (builder version, parameters, sha256 of every file), and a lock."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
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


def hash_tree(root: Path, subdirs: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    files: dict[str, dict[str, Any]] = {}
    for sub in subdirs:
        for p in sorted((root / sub).rglob("*")):
            if p.is_file():
                rel = p.relative_to(root).as_posix()
                files[rel] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    return files


def with_paths(manifest: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    out = dict(manifest)
    out["dir"] = str(out_dir)
    for role in ("target", "draft"):
        if (out_dir / role).is_dir():  # the Qwen cache may hold the 0.5B alone
            out[role] = str(out_dir / role)
    return out


def read_manifest(out_dir: Path, builder: str, version: int) -> dict[str, Any] | None:
    """The manifest in ``out_dir`` if that builder at that version wrote it, else None."""
    try:
        manifest = json.loads((out_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("builder") != builder or manifest.get("version") != version:
        return None
    return manifest


def files_intact(out_dir: Path, files: dict[str, dict[str, Any]], verify: bool) -> bool:
    """Are these manifest entries there with their sizes (and, with ``verify``, their
    sha256)?"""
    for rel, info in files.items():
        p = out_dir / rel
        if not p.is_file() or p.stat().st_size != info["bytes"]:
            return False
        if verify and sha256_file(p) != info["sha256"]:
            return False
    return True


def cached(
    out_dir: Path, builder: str, version: int, params: dict[str, Any], verify: bool
) -> dict[str, Any] | None:
    """The manifest in ``out_dir`` if it matches and its files are there, else None."""
    manifest = read_manifest(out_dir, builder, version)
    if manifest is None or manifest.get("params") != params:
        return None
    return manifest if files_intact(out_dir, manifest.get("files", {}), verify) else None


@contextlib.contextmanager
def locked(out_dir: Path) -> Iterator[None]:
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


def install_result(out_dir: Path, staging: Path, roles: tuple[str, ...]) -> None:
    """Move ``staging/<role>`` to ``out_dir/<role>``, replacing what was there."""
    stale = out_dir / MANIFEST
    if stale.exists():
        stale.unlink()
    for role in roles:
        dst = out_dir / role
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(staging / role, dst)


def write_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    tmp = out_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out_dir / MANIFEST)


def require(*modules: str, extra: str = "models") -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"adaptspec.tools.models needs {', '.join(missing)}: pip install 'adaptspec[{extra}]'"
        )
