"""pytest plugin that runs vLLM's own scheduler tests (its source distribution's tests/v1/core)
against adaptspec's schedulers: loaded with `-p vllm_peer_plugin` by tests/test_vllm_peer.py,
in a pytest of its own rooted in the extracted sdist.

PEER_CLASSES=adaptspec: every scheduler vLLM's `create_scheduler` builds without naming a class
is adaptspec's (AdaptiveAsyncScheduler under async scheduling, else AdaptiveScheduler), with a
policy that drafts every request at the engine's K (k_min at the cap), so vLLM's expectations of
a static K hold and what is checked is that adaptspec changes nothing else; with PEER_POLICY=
default, the shipped default policy instead (adaptspec decides K). PEER_CLASSES=vllm:
vLLM's own classes (the baseline). Either way the hub model the tests name by default
(facebook/opt-125m) is PEER_MODEL, a local folder; a test that needs another hub model cannot
run offline and is skipped. PEER_COUNT: a file the number of adaptspec schedulers built is
written to.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

POLICY = """
k_max: 64
default_class: default
classes:
  default: {k_min: 64}
"""
OFFLINE = "Invalid repository ID or local directory specified"
built = 0


def pytest_configure(config: pytest.Config) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import tests.v1.core.utils as u  # vLLM's helpers, before the test modules import them

    model = os.environ["PEER_MODEL"]
    ours = os.environ.get("PEER_CLASSES") == "adaptspec"
    if ours and os.environ.get("PEER_POLICY") != "default":
        path = os.path.join(os.environ["PEER_DIR"], "policy.yaml")
        with open(path, "w") as f:
            f.write(POLICY)
        os.environ["ADAPTSPEC_POLICY"] = path
    original = u.create_scheduler

    def create_scheduler(*args: Any, **kwargs: Any) -> Any:
        global built
        if not args and kwargs.get("model", "facebook/opt-125m") == "facebook/opt-125m":
            kwargs["model"] = model
        if ours and kwargs.get("scheduler_cls") is None:
            from adaptspec_vllm.scheduler import AdaptiveAsyncScheduler, AdaptiveScheduler

            kwargs["scheduler_cls"] = (AdaptiveAsyncScheduler if kwargs.get("async_scheduling")
                                       else AdaptiveScheduler)
            built += 1
        return original(*args, **kwargs)

    u.create_scheduler = create_scheduler


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator:
    report = yield
    if report.failed and call.excinfo is not None and OFFLINE in str(call.excinfo.value):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), None, "needs a hub model (offline)")
    return report


def pytest_unconfigure(config: pytest.Config) -> None:
    if path := os.environ.get("PEER_COUNT"):
        with open(path, "w") as f:
            f.write(str(built))
