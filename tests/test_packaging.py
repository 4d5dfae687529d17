"""The wheel, installed outside the repository, serves and checks policies from its own data:
the shipped policies are package data, and nothing reads a path of this checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    wheels, site, work = tmp_path / "wheels", tmp_path / "site", tmp_path / "work"
    work.mkdir()
    # No build isolation and no index: the build uses this environment's setuptools, offline.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), str(ROOT)], check=True)
    (wheel,) = wheels.glob("adaptspec-*.whl")
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

    where = subprocess.run([sys.executable, "-c", "import adaptspec.policy as p; "
                            "print(p.__file__); print(p.shipped_policy('default'))"],
                           cwd=work, env=env, capture_output=True, text=True, check=True)
    assert all(line.startswith(str(site)) for line in where.stdout.split()), where.stdout
    assert adaptspec("policy", "check", "default").startswith("default: OK")
    adaptspec("simulate", "--quick", "--json", str(work / "sim.json"))
    assert json.loads((work / "sim.json").read_text())
    cmd = adaptspec("serve", "--dry-run", "some/model")
    assert "some/model" in cmd and "--scheduler-cls" in cmd
