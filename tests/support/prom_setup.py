"""Where the Prometheus files the examples ship are, and Prometheus's binaries (None where not
installed: `make test-deps`, part of `make test`, installs Debian's prometheus package where
apt-get is available)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
ALERTS = EXAMPLES / "prometheus-alerts.yml"
SCRAPE_CONFIG = EXAMPLES / "prometheus.yml"


def _tool(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for p in (f"/usr/bin/{name}", f"/usr/local/bin/{name}") if os.access(p, os.X_OK)),
        None)


PROMETHEUS = _tool("prometheus")
PROMTOOL = _tool("promtool")
