"""The wheel, installed outside the repository, serves and checks policies from its own data:
the shipped policies are package data, and nothing reads a path of this checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from adaptspec.policy import SHIPPED, PolicyError, load_policy, shipped_policy

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_policy_loads_by_name(name: str) -> None:
    assert shipped_policy(name).name == f"{name}.yaml"
    assert load_policy(name) == load_policy(ROOT / "policies" / f"{name}.yaml")


def test_an_unknown_shipped_name_is_refused_with_the_list() -> None:
    with pytest.raises(PolicyError, match="shipped"):
        load_policy("defualt")


def test_the_wheel_installed_elsewhere_checks_simulates_and_dry_runs(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")
    src, wheels = tmp_path / "src", tmp_path / "wheels"
    site, work = tmp_path / "site", tmp_path / "work"
    work.mkdir()
    src.mkdir()
    # What the wheel is built from, copied (a build writes build/ and *.egg-info beside it).
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("adaptspec", "plugins", "policies"):
        shutil.copytree(ROOT / name, src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    # No build isolation and no index: the build uses this environment's setuptools, offline.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), str(src)], check=True)
    (wheel,) = wheels.glob("adaptspec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "adaptspec").rglob("__init__.py")}
    assert {f"{p}/__init__.py" for p in packages} <= names, "a package left out of the wheel"
    assert {"adaptspec/policies/default.yaml", "adaptspec_vllm/scheduler.py"} <= names
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), str(wheel)], check=True)
    # The wheel's files come first on the path; the dependencies are this environment's.
    env = {**os.environ, "PYTHONPATH": str(site)}

    def adaptspec(*args: str) -> str:
        out = subprocess.run([sys.executable, "-c", "import sys; from adaptspec.cli import main; "
                              "sys.exit(main())", *args], cwd=work, env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    # Every module of the package imports from the wheel (heavy tooling imports are lazy).
    where = subprocess.run(
        [sys.executable, "-c", "import importlib, pkgutil, adaptspec, adaptspec.policy as p\n"
         "for m in pkgutil.walk_packages(adaptspec.__path__, 'adaptspec.'):\n"
         "    if not m.name.endswith('__main__'): importlib.import_module(m.name)\n"
         "print(p.__file__); print(p.shipped_policy('default'))"],
        cwd=work, env=env, capture_output=True, text=True)
    assert where.returncode == 0, where.stderr
    assert all(line.startswith(str(site)) for line in where.stdout.split()), where.stdout
    assert adaptspec("policy", "check", "default").startswith("default: OK")
    adaptspec("simulate", "--quick", "--json", str(work / "sim.json"))
    assert json.loads((work / "sim.json").read_text())
    cmd = adaptspec("serve", "--dry-run", "some/model")
    assert "some/model" in cmd and "--scheduler-cls" in cmd
