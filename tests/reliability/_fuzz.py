"""What the bad-input tests share: hypothesis's settings (quick and long), strategies for values
of any shape, a scratch folder for the files they write, and the count of inputs tried (printed
after each module by conftest.py)."""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from pathlib import Path

from _rel import LONG
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = 1500 if LONG else 120
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not LONG,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TRIED: Counter[str] = Counter()
SCRATCH = Path(tempfile.mkdtemp(prefix="adaptspec-fuzz-"))

weird_scalars = st.one_of(
    st.none(), st.booleans(),
    st.sampled_from([-1, 0, 1, 2, 63, 64, 65, 10**6, 10**9, 2**63, -(2**63), 10**400]),
    st.integers(), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1.0, 0.5, 1e-300, 1e308, -0.0]),
    st.text(max_size=40), st.sampled_from(["", "x" * 10_000, "ünïcødé-类-🙂", "../../etc/passwd",
                                           "other", "default", "\x00", "a\nb: c"]),
)
json_like = st.recursive(weird_scalars, lambda c: st.lists(c, max_size=4)
                         | st.dictionaries(st.text(max_size=12), c, max_size=4), max_leaves=12)


def scratch_file(text: str | bytes, suffix: str = ".yaml") -> Path:
    fd, name = tempfile.mkstemp(suffix=suffix, dir=SCRATCH)
    with os.fdopen(fd, "wb") as f:
        f.write(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    return Path(name)
