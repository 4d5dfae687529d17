"""`adaptspec bench unseen` bookkeeping without servers: the streams, the groups, the verdict
(slice by slice against each group's plain server) and the table."""

from __future__ import annotations

import pytest

from adaptspec.tools.bench import unseen
from adaptspec.tools.bench.nopay import MAX_SERVERS
from adaptspec.tools.bench.prompts import load_unseen_chat


def test_streams_use_the_unseen_set_with_lc_in_every_other_slice() -> None:
    main, lc = unseen.make_streams(10, 64, 16, 4)
    short = [e["prompt"] for e in load_unseen_chat()["short"]]
    assert [r.prompt for r in main] == short[:10]
    assert all(r.temperature == 0.0 and r.max_tokens == 64 for r in main)
    assert [q is not None for q in lc] == [False, True, False]  # 3 slices of 4
    assert lc[1].cls == "interactive" and lc[1].max_tokens == 16


def test_every_group_has_plain_and_at_most_max_servers() -> None:
    gs = unseen.groups(list(unseen.CONFIGS))
    assert all(g[0].name == unseen.PLAIN and len(g) <= MAX_SERVERS for g in gs)
    others = [c.name for g in gs for c in g[1:]]
    assert sorted(others) == sorted(c.name for c in unseen.CONFIGS if c.name != unseen.PLAIN)
    plain = unseen.CONFIGS[0]
    assert plain.spec is None and plain.account and not plain.adaptive
    # each adaptive configuration beside its static pair, whatever else was chosen
    for adaptive, static in unseen.PAIRS.items():
        assert any({adaptive, static} <= {c.name for c in g} for g in gs)
        assert [[c.name for c in g] for g in unseen.groups(unseen.chosen([adaptive, static]))] \
            == [[unseen.PLAIN, static, adaptive]]
    assert [[c.name for c in g] for g in unseen.groups(unseen.chosen(["adaptspec"]))] == \
        [[unseen.PLAIN, "adaptspec"]]


def test_fixed_k2_runs_only_when_named() -> None:
    """adaptspec_k2 (adaptspec's machinery at K=2, for a static K's engine account) is a
    diagnostic: not in the default run, which the goals and the README's table come from."""
    assert unseen.FIXED_K2.name not in [c.name for c in unseen.chosen(None)]
    assert [c.name for c in unseen.chosen(["adaptspec", "adaptspec_k2"])] == \
        [unseen.PLAIN, "adaptspec", "adaptspec_k2"]
    assert unseen.FIXED_K2.name not in unseen.ADAPTIVE  # no goals are judged on it


def _run(walls: list[float], gap: float, ref_walls: list[float], ref_gap: float) -> dict:
    return {"slice_wall_s": walls, "lc_median_gap_ms": gap, "wall_s": sum(walls),
            "reference": {"slice_wall_s": ref_walls, "lc_median_gap_ms": ref_gap}}


def test_verdict_pairs_slices_with_and_without_lc() -> None:
    lc = [False, True, False, True]
    plain = [10.0, 12.0, 10.0, 12.0]
    rep = {"vllm_ngram_k4": _run([8.0, 12.0, 9.0, 13.0], 110.0, plain, 100.0),
           "vllm_ngram_k8": _run([9.0, 14.0, 9.0, 14.0], 130.0, plain, 100.0),
           "adaptspec": _run([8.0, 12.0, 8.0, 12.0], 102.0, plain, 100.0)}
    v = unseen.judge([rep], lc)
    assert v["vllm_ngram_k4"]["no_lc"]["median"] == pytest.approx(20 / 17)
    assert v["vllm_ngram_k4"]["with_lc"]["median"] == pytest.approx(24 / 25)
    assert v["adaptspec"]["lc_gap"]["median"] == pytest.approx(1.02)
    g = v["goals"]["adaptspec"]
    assert g["no_lc_over_best_static"] == pytest.approx((20 / 16) / (20 / 17))
    assert g["with_lc_over_plain"] == pytest.approx(1.0)
    # repeats: medians and spreads
    rep2 = {k: dict(r) for k, r in rep.items()}
    rep2["adaptspec"] = _run([10.0, 12.0, 10.0, 12.0], 100.0, plain, 100.0)
    rep3 = {k: dict(r) for k, r in rep.items()}
    rep3["adaptspec"] = _run([9.0, 12.0, 11.0, 12.0], 100.0, plain, 100.0)
    v3 = unseen.judge([rep, rep2, rep3], lc)
    a = v3["adaptspec"]["no_lc"]
    assert a["per_repeat"] == pytest.approx([1.25, 1.0, 1.0])
    assert a["median"] == pytest.approx(1.0) and a["spread"] == pytest.approx(0.25)
    # no K=2 server in these repeats: nothing to pair with
    assert v3["goals"]["adaptspec"]["paired"] is None
    for r in (rep, rep2, rep3):
        r["vllm_ngram_k2"] = _run([10.0, 12.0, 8.0, 12.0], 120.0, plain, 100.0)  # 20/18 no LC
    pair = unseen.judge([rep, rep2, rep3], lc)["goals"]["adaptspec"]["paired"]
    assert pair["over"] == "vllm_ngram_k2"
    assert pair["per_repeat"] == pytest.approx([1.25 * 18 / 20, 18 / 20, 18 / 20])
    assert pair["median"] == pytest.approx(0.9)


def test_pairing_follows_the_group_each_result_ran_in() -> None:
    """Over vLLM's n-gram, beside K=2 in one group (`--configs vllm_ngram_k2
    adaptspec_vllm_ngram`), the pair is K=2, not PAIRS' K=4 that did not run; results of a run
    that recorded no groups keep PAIRS'."""
    lc = [False, True]
    plain = [10.0, 10.0]
    rep = {"vllm_ngram_k2": {**_run([8.0, 10.0], 100.0, plain, 100.0), "group": 0},
           "vllm_ngram_k8": {**_run([9.0, 10.0], 100.0, plain, 100.0), "group": 1},
           "adaptspec_vllm_ngram": {**_run([10.0, 10.0], 100.0, plain, 100.0), "group": 0}}
    assert unseen.pair_of([rep], "adaptspec_vllm_ngram") == "vllm_ngram_k2"
    pair = unseen.judge([rep], lc)["goals"]["adaptspec_vllm_ngram"]["paired"]
    assert pair["over"] == "vllm_ngram_k2" and pair["median"] == pytest.approx(0.8)
    rep["vllm_ngram_k2"]["group"] = 1  # K=2 elsewhere, nothing static beside it
    assert unseen.pair_of([rep], "adaptspec_vllm_ngram") is None
    assert unseen.judge([rep], lc)["goals"]["adaptspec_vllm_ngram"]["paired"] is None
    # nor PAIRS' K=4 where it ran in another group
    rep["vllm_ngram_k4"] = {**_run([8.0, 10.0], 100.0, plain, 100.0), "group": 1}
    assert unseen.judge([rep], lc)["goals"]["adaptspec_vllm_ngram"]["paired"] is None
    del rep["vllm_ngram_k4"]
    for r in rep.values():
        del r["group"]
    assert unseen.pair_of([rep], "adaptspec_vllm_ngram") == "vllm_ngram_k4"


def test_table_and_account_share() -> None:
    lc = [False, True]
    plain = {"slice_wall_s": [10.0, 10.0], "lc_median_gap_ms": 100.0, "wall_s": 20.0,
             "vllm_draft_tokens": 0.0, "vllm_accepted_tokens": 0.0,
             "engine_s": {"decode_plain": 15.0, "prefill": 4.7, "idle": 30.0}}
    a = {**_run([9.0, 10.0], 101.0, [10.0, 10.0], 100.0), "vllm_draft_tokens": 50.0,
         "vllm_accepted_tokens": 20.0}
    assert unseen.account_share(plain) == pytest.approx(19.7 / 20.0)  # idle is not serving
    assert unseen.account_share(a) is None
    table = unseen.format_table([{"none_sync": plain, "adaptspec": a}],
                                unseen.judge([{"none_sync": plain, "adaptspec": a}], lc))
    assert "0.985" in table and "50/20" in table and "1.111" in table


def test_decode_rate_is_per_request_decoding_over_its_group_plain() -> None:
    def req(times: list[float], tokens: list[int]) -> dict:
        return {"chunk_times": times, "chunk_tokens": tokens}

    # two requests: 4 + 2 tokens after the first, over 1.0 + 1.0 s of decoding
    plain = {"requests": [req([0.5, 1.0, 1.5], [1, 2, 2]), req([0.2, 1.2], [1, 2]),
                          req([0.3], [1])]}
    assert unseen.decode_rate(plain) == pytest.approx(3.0)
    assert unseen.decode_rate({"requests": [req([0.3], [1])]}) is None
    fast = {"requests": [req([0.5, 1.0], [1, 3])], "reference": {"decode_rate": 2.0}}
    rep = {unseen.PLAIN: plain, "adaptspec": fast}
    assert unseen.decode_over_plain(rep, "adaptspec") == pytest.approx(3.0)  # 6 / 2
    del fast["reference"]  # a run that kept no reference rate: the repeat's plain server
    assert unseen.decode_over_plain(rep, "adaptspec") == pytest.approx(2.0)


def test_own_plain_decode_is_within_one_server() -> None:
    """Decode steps' tokens per second over the same server's plain steps at the concurrency:
    plain at 4 requests is 1; speculation that makes 20 tokens more in 2 s more is not."""
    def dec(plain: dict[str, tuple[float, float]], spec: dict[str, tuple[float, float]]) -> dict:
        return {"decode_plain": {b: {"steps": n, "ms_per_step": ms, "drafts_per_step": 0.0}
                                 for b, (n, ms) in plain.items()},
                "decode_spec": {b: {"steps": n, "ms_per_step": ms, "drafts_per_step": 2.0}
                                for b, (n, ms) in spec.items()}}

    plain = {"engine_decode": dec({"4": (100.0, 400.0)}, {}), "vllm_accepted_tokens": 0.0}
    assert unseen.own_plain_decode(plain, 4) == pytest.approx(1.0)
    # 50 plain steps at 4 (200 tokens, 20 s) and 40 speculating steps at 4 that accepted 60
    # (220 tokens, 20 s): 420 tokens in 40 s against 4 tokens per 0.4 s
    spec = {"engine_decode": dec({"4": (50.0, 400.0)}, {"4": (40.0, 500.0)}),
            "vllm_accepted_tokens": 60.0}
    assert unseen.own_plain_decode(spec, 4) == pytest.approx(420 / 40 * 0.4 / 4)
    # batches left as requests finish unevenly count at their own (worse) rate
    tail = {"engine_decode": dec({"4": (10.0, 400.0), "2": (10.0, 400.0)}, {}),
            "vllm_accepted_tokens": 0.0}
    assert unseen.own_plain_decode(tail, 4) == pytest.approx(60 / 8 * 0.4 / 4)
    assert unseen.own_plain_decode({"engine_decode": dec({"2": (1.0, 1.0)}, {})}, 4) is None
    assert unseen.own_plain_decode({}, 4) is None


def test_beside_lc_reads_the_batches_that_hold_a_latency_critical_request() -> None:
    """At C + 1 requests (C main clients and one latency-critical request): how many of a
    server's decode steps drafted, and its plain ones' speed over its group's plain server's
    there, which is what the latency-critical gap is when none drafted."""
    def dec(plain: dict[str, float], spec: dict[str, float]) -> dict:
        return {"decode_plain": {b: {"steps": 10.0, "ms_per_step": ms, "drafts_per_step": 0.0}
                                 for b, ms in plain.items()},
                "decode_spec": {b: {"steps": 4.0, "ms_per_step": ms, "drafts_per_step": 2.0}
                                for b, ms in spec.items()}}

    plain = {"engine_decode": dec({"4": 400.0, "5": 440.0}, {})}
    a = {"engine_decode": dec({"4": 400.0, "5": 484.0}, {"4": 450.0, "5": 520.0}),
         "reference": {"engine_decode": dec({"5": 400.0}, {})}}
    rep = {unseen.PLAIN: plain, "adaptspec": a}
    assert unseen.beside_lc(rep, "adaptspec", 5) == pytest.approx(
        {"spec_steps": 4.0, "plain_steps": 10.0, "plain_x_plain": 484 / 400})
    del a["reference"]  # no reference account kept: the repeat's plain server
    assert unseen.beside_lc(rep, "adaptspec", 5)["plain_x_plain"] == pytest.approx(1.1)
    assert unseen.beside_lc(rep, "adaptspec", 6) is None
    assert unseen.beside_lc({unseen.PLAIN: plain, "k2": {}}, "k2", 5) is None
    table = unseen.format_table([{unseen.PLAIN: {**plain, **_run([1.0], 1.0, [1.0], 1.0),
                                                 "vllm_draft_tokens": 0.0,
                                                 "vllm_accepted_tokens": 0.0},
                                  "adaptspec": {**a, **_run([1.0], 1.0, [1.0], 1.0),
                                                "vllm_draft_tokens": 8.0,
                                                "vllm_accepted_tokens": 4.0}}],
                                {}, batch=4)
    assert "beside LC (5 requests) drafting steps 4/14; its plain steps there x plain's 1.100" \
        in table


def test_time_split_is_each_category_less_plain_over_plain_wall() -> None:
    """Seconds per account category less the group's plain server's, over plain's wall time of
    the slices with (or without) a latency-critical stream: decode counts both kinds of
    decode step, and the parts sum to the total."""
    def acct(dp: float, ds: float, pre: float, first: float, between: float) -> dict:
        return {"s_decode_plain": dp, "s_decode_spec": ds, "s_prefill": pre,
                "s_first_shape": first, "s_between": between}

    lc = [False, True]
    plain = {"slice_wall_s": [50.0, 40.0],
             "slice_engine": [acct(30, 0, 20, 0, 0), acct(25, 0, 15, 0, 0)]}
    a = {"slice_engine": [acct(10, 15, 21, 3, 1), acct(10, 16, 16, 0, 0.5)],
         "reference": {"slice_wall_s": [50.0, 40.0],
                       "slice_engine": [acct(30, 0, 20, 0, 0), acct(25, 0, 15, 0, 0)]}}
    rep = {unseen.PLAIN: plain, "adaptspec": a}
    no_lc = unseen.time_split(rep, "adaptspec", lc, lc=False)
    assert no_lc == pytest.approx({"decode": -5 / 50, "prefill": 1 / 50, "first_shape": 3 / 50,
                                   "between": 1 / 50, "total": 0.0})
    with_lc = unseen.time_split(rep, "adaptspec", lc, lc=True)
    assert with_lc == pytest.approx({"decode": 1 / 40, "prefill": 1 / 40, "first_shape": 0.0,
                                     "between": 0.5 / 40, "total": 2.5 / 40})
    # a run that kept no reference account compares with the repeat's plain server
    rep["adaptspec"] = {"slice_engine": a["slice_engine"]}
    assert unseen.time_split(rep, "adaptspec", lc, lc=True) == pytest.approx(with_lc)
    table = unseen.split_table([rep], lc)
    assert "+0.062" in table and "-0.100" in table
    # a server without an account (vLLM's static configurations) has none
    assert unseen.time_split({unseen.PLAIN: plain, "k2": {"slice_engine": [{}, {}]}},
                             "k2", lc, lc=True) is None
    assert unseen.split_table([{unseen.PLAIN: plain}], lc) == ""


def test_a_run_writes_each_finished_repeat_so_a_run_cut_short_keeps_them(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """After every repeat but the last the repeats so far go to unseen.partial.json, judged
    and tabled as the whole run's file is: a long run killed at its deadline keeps them."""
    import argparse

    written: list[tuple[str, list[int]]] = []
    monkeypatch.setattr(unseen, "prepare", lambda model, main, lc: ("m", [], {}))
    monkeypatch.setattr(unseen, "run_repeat", lambda group, *a, **k: {
        c.name: {"repeat": a[7], "slice_wall_s": [], "lc_median_gap_ms": 0.0,
                 "slice_engine": []} for c in group})
    monkeypatch.setattr(unseen, "decode_rate", lambda ref: 1.0)

    def finish(args, repeats, lc, model, t_all, path):  # (what the real one judges)
        written.append((path.name, [r[unseen.PLAIN]["repeat"] for r in repeats]))
        return 0

    monkeypatch.setattr(unseen, "finish", finish)
    args = argparse.Namespace(
        slice_requests=None, concurrency=4, requests=16, max_tokens=64, lc_tokens=16,
        model=None, out=str(tmp_path), configs=["vllm_ngram_k2", "adaptspec",
                                                "vllm_ngram_k4", "adaptspec_vllm_ngram"],
        repeats=3, policy=None, compiled=False)
    assert unseen.run(args) == 0
    assert written == [("unseen.partial.json", [0]), ("unseen.partial.json", [0, 1]),
                       ("unseen.json", [0, 1, 2])]


def test_reach_by_position_of_an_adaptive_and_of_a_static_server() -> None:
    # adaptive: its own counters, every class summed; a position no draft reached is left out
    adaptive = {"adaptspec_counters": {
        "chat": {"drafted_pos0": 10.0, "drafted_pos1": 8.0, "drafted_pos2": 0.0,
                 "accepted_pos0": 6.0, "accepted_pos1": 2.0},
        "code": {"drafted_pos0": 10.0, "accepted_pos0": 4.0, "drafted": 10.0}},
        "vllm_drafts": 99.0, "vllm_accepted_pos": {"0": 1.0}}
    assert unseen.reach_by_position(adaptive) == pytest.approx([0.5, 0.25])
    # static K: vLLM's accepted per position over its drafts, in position order
    static = {"adaptspec_counters": {}, "vllm_drafts": 20.0,
              "vllm_accepted_pos": {"1": 5.0, "0": 12.0}}
    assert unseen.reach_by_position(static) == pytest.approx([0.6, 0.25])
    assert unseen.reach_by_position({"adaptspec_counters": {}, "vllm_drafts": 0.0}) is None
    table = unseen.format_table(
        [{"none_sync": {**_run([9.0, 9.0], 100.0, [9.0, 9.0], 100.0), "vllm_draft_tokens": 0.0,
                        "vllm_accepted_tokens": 0.0},
          "vllm_ngram_k2": {**_run([9.0, 9.0], 100.0, [10.0, 10.0], 100.0), **static,
                            "vllm_draft_tokens": 40.0, "vllm_accepted_tokens": 17.0}}],
        {})
    assert "vllm_ngram_k2: drafts accepted through each position" in table
    assert table.rstrip().count("0.60 0.25") == 1


def test_static_servers_keep_the_account_under_sync_scheduling_only() -> None:
    from adaptspec.tools.bench.servers import Config

    static = [c for c in unseen.CONFIGS if c.name in unseen.STATIC]
    assert static and all(c.account and c.sync and not c.adaptive for c in static)
    # AccountScheduler is vLLM's synchronous scheduler: an async static server is refused
    with pytest.raises(ValueError, match="sync scheduling"):
        Config("k2_async", static[0].spec, account=True)
    Config("plain_async", None, account=True)  # plain: AdaptiveScheduler keeps the account
