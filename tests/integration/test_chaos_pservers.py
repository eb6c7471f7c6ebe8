"""The chaos suite with pservers (``--pservers S``): a plan with pservers kills one and a plan
without is unchanged, the time until the rate is back after a kill, a 15 s run with two local
pservers behind a head of headers (one killed, and the daemon) that loses and doubles nothing and
ends with its slices at the head's last checkpoint, and the slices' checks themselves (of a head
with parameters and of one without). A file of its own, so that the test
processes run it beside the smoke run of ``test_chaos.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetd.bench.chaos import ChaosOptions, run_chaos
from hetd.bench.chaos.cluster import Cluster
from hetd.bench.chaos.faults import schedule
from hetd.bench.chaos.pservers import back_verdict, updates_back
from hetd.sim.results import PolicySpec


def test_a_plan_with_pservers_kills_one_and_a_plan_without_is_unchanged() -> None:
    def plan(servers: int, seed: int) -> list[tuple[float, str, int]]:
        opts = ChaosOptions(
            policies=(PolicySpec("asp"),), out=Path("."), workers=2, minutes=0.5,
            fault_every=6.0, seed=seed, pservers=servers,
        )  # fmt: skip
        return [(f.at_s, f.kind, f.slot) for f in schedule(opts)]

    for seed in range(20):
        with_ps = plan(2, seed)
        kinds = [k for _, k, _ in with_ps]
        assert "kill_pserver" in kinds and kinds.count("kill_daemon") == 1
        assert all(0 <= s < 2 for _, k, s in with_ps if k == "kill_pserver")
        assert "kill_pserver" not in [k for _, k, _ in plan(0, seed)]
    # without pservers the seed draws the plan it drew before pservers existed
    assert plan(0, 0) == [
        (6.0, "stall_worker", 1), (12.0, "kill_worker", 1), (18.0, "kill_daemon", -1),
        (24.0, "cut_worker", 1),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="--pservers must be >= 0"):
        schedule(ChaosOptions(policies=(PolicySpec("asp"),), out=Path("."), pservers=-1))


def test_updates_back_is_the_first_window_after_the_kill_at_half_the_rate_before(
    tmp_path: Path,
) -> None:
    c = Cluster(
        ChaosOptions(policies=(PolicySpec("asp"),), out=tmp_path, pservers=2),
        PolicySpec("asp"),
        "t",
    )
    try:
        # 10 updates/s until the kill at t = 10, none for 3 s, then 10/s again
        ua = 0
        for i in range(0, 301):
            t = i * 0.1
            if not 10.0 < t <= 13.0:
                ua += 0 if i == 0 else 1
            c.series.append((t, ua, ua, 2))
        got = updates_back(c, 10.0)
        assert got["rate_before_kill"] == pytest.approx(10.0, rel=0.06)
        # [u - 2, u] holds >= 10 updates once u >= 14: back 4 s after the kill
        assert got["updates_back_s"] == pytest.approx(4.0, abs=0.11)
        assert "met" in back_verdict([got["updates_back_s"]])
        assert back_verdict([4.0, 12.5]).endswith("within 12.5 s (target <= 10 s): NOT met")
        assert back_verdict([4.0, None]).endswith("NOT met")
        c.series = [(t, 0, 0, 2) for t, *_ in c.series]  # no rate before: nothing measured
        assert updates_back(c, 10.0)["updates_back_s"] is None
    finally:
        c.tmp.cleanup()


@pytest.mark.timeout(1200)
def test_chaos_with_two_pservers_one_killed_behind_a_head_of_headers_is_exactly_once(
    tmp_path: Path,
) -> None:
    """15 s with 2 workers and 2 local pservers behind a head that takes push headers only and
    holds no parameters: a pserver killed at 5 s and the daemon at 10 s (it restarts from a
    checkpoint without parameters, its pservers loading their slices saved there). Nothing is
    applied twice or lost, every pull's slices verify, the killed pserver is restarted, and in
    each run the slices saved at the last checkpoint stand at its log position and version, join
    into the model, are finite and consumed the same pushes. (A head of whole pushes: its slices
    against the head's parameters bit for bit, the check below this test and
    test_pserver_train's kill.) The time until the rate is back is printed by the bench, not
    asserted (timings on a loaded machine)."""
    opts = ChaosOptions(
        policies=(PolicySpec("asp"),), out=tmp_path, workers=2, minutes=15 / 60, fault_every=5.0,
        seed=0, quiet=True, pservers=2, headers=True,
    )  # fmt: skip
    doc = run_chaos(opts)
    assert doc["options"]["pserver_heads"] == "headers"
    (p,) = doc["policies"]
    assert p["duplicate_or_partial_applies"] == 0 and p["hash_mismatches"] == 0
    assert p["parts_dropped"] == 0  # no push waited past the part timeout and was dropped
    assert p["pserver_heads"] == "headers"
    assert p["slices_match_head"] is True, p["slices_why"]
    for got in [p["chaos"]["slices"], *p["baseline"]["slices"]]:  # the check without parameters
        assert got["slice_positions"] == [got["head_position"]] * 2
        assert got["slice_versions"] == [got["head_version"]] * 2 and got["head_version"] > 0
    assert p["daemon_restarted"] is True and p["workers_back"] is True
    kills = [f for f in p["chaos"]["faults"] if f["kind"] == "kill_pserver"]
    assert [f["at_s"] for f in kills] == [5.0]
    assert p["pserver_kills"] >= 1 and p["pservers_restarted"] is True
    for f in kills:
        if "pid_killed" in f:  # (one that found its pserver not running is skipped)
            assert f["pid_new"] not in (None, f["pid_killed"])
            assert f["reconnected_s"] >= f["new_pid_s"] > 0
    assert p["chaos"]["versions_gained"] > 0
    assert p["verdict"] == "pass" or p["failures"] == [
        f"{p['versions_lost']} versions lost, more than {p['lost_bound']}"
    ]
    text = (tmp_path / "chaos.md").read_text()
    assert "pserver kill: " in text and "taking each push's header only" in text


def test_the_slices_check_finds_a_slice_that_differs_from_the_head(tmp_path: Path) -> None:
    """The check the pservers run ends with, on files written by the daemon's and the pservers'
    own writers: a head checkpoint and two slices (one tensor cut in row blocks) that join to it
    pass; one flipped bit, or a slice saved at another position, fails, saying why."""
    import json as json_

    import numpy as np

    from hetd.bench.chaos.slices import slices_against_head
    from hetd.protocol.pslink import part_key
    from hetd.pserver import disk
    from hetd.pserver.slice import SliceSaved
    from hetd.server import checkpoint

    rng = np.random.default_rng(0)
    head: dict[str, np.ndarray] = {
        "a/kernel": rng.normal(size=(6, 3)).astype(np.float32),
        "b": np.asarray(rng.normal(), np.float32),
    }

    def head_at(position: int) -> None:  # the head's checkpoint at that log position
        place = json_.dumps({"position": position, "version": 20, "groups": [], "last_pid": []})
        checkpoint.write(
            tmp_path, {"version": 20, "params": head, "opt_state": {}, "decisions": place}, keep=3
        )

    head_at(40)
    cut = [
        {part_key("a/kernel", 0, 4, False): head["a/kernel"][:4], "b": head["b"]},
        {part_key("a/kernel", 4, 6, False): head["a/kernel"][4:]},
    ]

    def save(slices: list[dict[str, np.ndarray]], positions: tuple[int, int]) -> None:
        for s, (params, position) in enumerate(zip(slices, positions, strict=True)):
            saved = SliceSaved(params, [], 20, position, {})
            disk.save(tmp_path / "pservers" / f"slice{s}", saved, ref=f"p{position}", epoch="e")

    save(cut, (40, 40))
    assert slices_against_head(tmp_path, 2)["match"] is True
    flipped = cut[1][part_key("a/kernel", 4, 6, False)].copy()
    flipped.view(np.uint32)[0, 0] ^= 1  # one bit of one value
    save([cut[0], {part_key("a/kernel", 4, 6, False): flipped}], (41, 41))
    head_at(41)
    got = slices_against_head(tmp_path, 2)
    assert got["match"] is False and got["why"] == "1 tensors differ, first 'a/kernel'"
    save(cut, (42, 43))
    got = slices_against_head(tmp_path, 2)
    assert got["match"] is False and "other log positions" in got["why"]
    assert slices_against_head(tmp_path, 3) == {"match": False, "why": "pserver 2 saved no slice"}
    save([cut[0], {}], (45, 45))  # a block of a/kernel in no slice
    head_at(45)
    got = slices_against_head(tmp_path, 2)
    assert got["match"] is False and got["why"] == "the slices do not cover 'a/kernel' exactly once"


def test_the_headers_check_finds_slices_that_disagree_with_a_head_without_parameters(
    tmp_path: Path,
) -> None:
    """The check a run whose head holds no parameters ends with, on files written by the daemon's
    and the pservers' own writers, the map planned from a chaos run's own daemon config: two
    slices at the checkpoint's position and version, that join into the model and consumed the
    same pushes, pass; a slice at another position or version, one that consumed another push,
    a part missing, or a value not finite fails, saying why."""
    import json as json_

    import numpy as np

    from hetd.bench.chaos.cluster import _config_text
    from hetd.bench.chaos.slices import check, partition_map
    from hetd.pserver import disk
    from hetd.pserver.partition import split
    from hetd.pserver.slice import SliceSaved
    from hetd.server import checkpoint

    opts = ChaosOptions(policies=(PolicySpec("asp"),), out=tmp_path, pservers=2, headers=True)
    config = tmp_path / "hetd.toml"
    config.write_text(_config_text(opts, PolicySpec("asp"), 1, 2, str(tmp_path), "127.0.0.1"))
    assert "headers = true" in config.read_text()
    pmap = partition_map(config)
    assert pmap.servers == 2 and pmap.of(0) and pmap.of(1)
    rng = np.random.default_rng(0)
    model = {k: rng.normal(size=s).astype(np.float32) for k, s in pmap.shapes.items()}
    cut = split(pmap, model)
    done = {0: 7, 1: 9}
    n = [0]  # the head's checkpoints written

    def head_at(position: int, version: int = 20) -> None:  # a checkpoint without parameters
        place = json_.dumps(
            {"position": position, "version": version, "groups": [], "last_pid": []}
        )
        checkpoint.write(
            tmp_path, {"version": version, "params": {}, "opt_state": {}, "decisions": place}, 3
        )
        n[0] += 1

    def save(
        slices: list[dict[str, np.ndarray]], at: list[tuple[int, int, dict[int, int]]]
    ) -> None:
        for s, (params, (position, version, consumed)) in enumerate(zip(slices, at, strict=True)):
            saved = SliceSaved(params, [], version, position, {}, consumed)
            disk.save(tmp_path / "pservers" / f"slice{s}", saved, ref=f"p{position}", epoch="e")

    def got() -> dict[str, object]:
        return check(tmp_path, 2, True, config)

    head_at(40)
    save(cut, [(40, 20, done)] * 2)
    ok = got()
    assert ok["match"] is True and ok["tensors"] == len(pmap.shapes), ok
    save(cut, [(41, 20, done), (42, 20, done)])
    head_at(41)
    assert "other log positions" in str(got()["why"])
    save(cut, [(43, 20, done), (43, 21, done)])
    head_at(43)
    assert got()["why"] == "the slices were saved at other versions"
    save(cut, [(44, 20, done), (44, 20, {0: 7, 1: 8})])
    head_at(44)
    assert got()["why"] == "the slices consumed other pushes (done differs)"
    key = pmap.of(1)[0].key
    save([cut[0], {k: v for k, v in cut[1].items() if k != key}], [(45, 20, done)] * 2)
    head_at(45)
    assert got()["why"] == f"the slices do not join: slice 1 lacks part {key!r}"
    bad = {k: v.copy() for k, v in cut[1].items()}
    bad[key].reshape(-1)[0] = np.nan
    save([cut[0], bad], [(46, 20, done)] * 2)
    head_at(46)
    assert got()["why"] == f"1 tensors not finite, first {pmap.of(1)[0].path!r}"
    # a head that holds parameters is the whole-push check's, not this one's
    checkpoint.write(
        tmp_path,
        {
            "version": 20,
            "params": model,
            "opt_state": {},
            "decisions": json_.dumps({"position": 47}),
        },
        3,
    )
    assert got()["why"] == "the head's checkpoint holds parameters"
