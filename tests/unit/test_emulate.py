"""``workers.emulate``: the schedule arithmetic of an emulated worker (slow-down, regime shifts,
straggle episodes, link latency and bandwidth) with injected time, and the ``hetd-worker`` flags
that build it."""

from __future__ import annotations

import argparse
import os

import numpy as np
import pytest

from workers import cli
from workers.emulate import (
    BEFORE,
    Emulation,
    ScheduleClock,
    origin_from_wall,
    parse_origin,
    parse_shift,
)

BASE = 0.01  # s per 32 samples before the slow-down


def shifted(**changes: object) -> Emulation:
    """Slow-down 2 until 1 s, then 4; at 5 s two shifts at once (the later one, 1.5, wins)."""
    fields: dict[str, object] = {
        "slowdown": 2.0,
        "base_step_s": BASE,
        "shifts": [(5.0, 3.0), (1.0, 4.0), (5.0, 1.5)],
        **changes,
    }
    return Emulation(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("compute_s", "samples", "now", "expected"),
    [
        (0.001, 32, BEFORE, 2 * BASE),  # before the origin: the initial slow-down
        (0.001, 32, -3.0, 2 * BASE),  # an origin still ahead: the same
        (0.001, 32, 0.0, 2 * BASE),
        (0.001, 32, 0.999, 2 * BASE),  # just before the shift
        (0.001, 32, 1.0, 4 * BASE),  # at the shift: the new slow-down
        (0.001, 64, 2.0, 4 * 2 * BASE),  # the base step scales with the samples
        (0.001, None, 2.0, 4 * BASE),  # no sample count: one base batch
        (0.05, 32, 0.5, 0.05),  # real compute above the slowed base: a floor, never slowed
        (0.015, 32, 0.5, 2 * BASE),  # above the base but below the slowed base: the slowed base
        (0.009, 4, 0.5, 0.009),  # a tiny share: the host's fixed cost is not multiplied
        (0.001, 32, 5.0, 1.5 * BASE),  # two shifts at one time: the later one given
        (0.001, 32, 1e6, 1.5 * BASE),
    ],
)
def test_a_step_takes_the_slowdown_in_force_when_it_starts(
    compute_s: float, samples: int | None, now: float, expected: float
) -> None:
    assert shifted().step_seconds(compute_s, samples, now) == pytest.approx(expected)


def test_without_a_base_step_the_slowdown_multiplies_the_real_compute() -> None:
    assert Emulation(slowdown=3.0).step_seconds(0.02, 32, 0.0) == pytest.approx(0.06)


@pytest.mark.parametrize(
    ("t", "slowdown"), [(BEFORE, 2.0), (0.0, 2.0), (1.0, 4.0), (4.99, 4.0), (5.0, 1.5)]
)
def test_slowdown_at_follows_the_shifts_as_the_simulator_does(t: float, slowdown: float) -> None:
    assert shifted().slowdown_at(t) == slowdown


def test_the_simulators_rule_for_shifts_gives_the_same_slowdowns() -> None:
    from hetd.sim.scenario import Scenario, Shift, WorkerSpec

    sc = Scenario(
        name="x",
        dataset="digits",
        model="mlp",
        workers=(WorkerSpec(slowdown=2.0),),
        shifts=(Shift(0, 3.0, at_s=5.0), Shift(0, 4.0, at_s=1.0), Shift(0, 1.5, at_s=5.0)),
    )
    emu = shifted()
    for t in (0.0, 0.5, 1.0, 3.0, 5.0, 7.0):
        assert emu.slowdown_at(t) == sc.slowdown_at(0, t)


def test_the_clock_gives_a_steps_start_in_schedule_time() -> None:
    now = [100.0]
    clock = ScheduleClock(lambda: now[0])  # origin not known yet (stdin)
    emu = shifted(clock=clock)
    assert clock.started(0.5) == BEFORE
    assert emu.step_seconds(0.001, 32) == pytest.approx(2 * BASE)  # before the origin
    clock.set_origin(98.0)
    now[0] = 99.2
    # The step ended at 1.2 s and took 0.1 s: it started at 1.1 s, after the shift at 1 s.
    assert emu.step_seconds(0.1, 3200) == pytest.approx(4 * 100 * BASE)
    # Ended at 1.2 s, took 0.3 s: started at 0.9 s, before the shift.
    assert emu.step_seconds(0.3, 3200) == pytest.approx(2 * 100 * BASE)


def test_first_step_origin_is_the_start_of_the_first_step() -> None:
    now = [50.0]
    clock = ScheduleClock(lambda: now[0], first_step=True)
    assert clock.started(0.25) == 0.0
    assert clock.origin == 49.75
    now[0] = 52.0
    assert clock.started(0.25) == pytest.approx(2.0)


def test_a_unix_time_origin_becomes_a_reading_of_the_monotonic_clock() -> None:
    # The wall clock shows 1003 while the monotonic one shows 50: wall time 1000 was at 47.
    assert origin_from_wall(1000.0, 1003.0, 50.0) == 47.0
    assert origin_from_wall(1010.0, 1003.0, 50.0) == 57.0  # an origin still to come


def factors(emu: Emulation, steps: int, now: float = 0.0) -> list[float]:
    """The straggle multiplier of each of ``steps`` steps (slow-down 1, padded compute 1 s)."""
    return [emu.step_seconds(1.0, 32, now) for _ in range(steps)]


def stragglers(seed: int, p: float = 0.05, factor: float = 3.0, mean: float = 4.0) -> Emulation:
    return Emulation(stragglers=p, straggle_factor=factor, straggle_mean=mean, seed=seed)


def test_straggle_episodes_are_reproducible_per_seed() -> None:
    a, b, c = factors(stragglers(7), 500), factors(stragglers(7), 500), factors(stragglers(8), 500)
    assert a == b
    assert a != c
    assert set(a) == {1.0, 3.0}


def test_straggle_episodes_follow_the_simulators_straggler_draw_for_draw() -> None:
    from hetd.sim.compute import Straggler
    from hetd.sim.scenario import Stragglers

    sim = Straggler(Stragglers(p=0.05, factor=3.0, mean_len=4.0), np.random.default_rng(7))
    assert factors(stragglers(7), 2000) == [sim.factor() for _ in range(2000)]


def test_straggle_episodes_have_the_scenarios_rate_and_mean_length() -> None:
    from hetd.sim.scenario import Stragglers

    steps = factors(stragglers(3, p=0.02, factor=5.0, mean=10.0), 60_000)
    slow = np.array(steps) > 1.0
    expected = Stragglers(0.02, 5.0, 10.0).slow_fraction()  # 1/6
    assert slow.mean() == pytest.approx(expected, rel=0.15)
    # Episodes are runs of slow steps (two back to back merge: rare at p = 0.02).
    starts = np.flatnonzero(slow[1:] & ~slow[:-1])
    assert slow.sum() / len(starts) == pytest.approx(10.0 / (1 - 0.02 * 10 / 11), rel=0.15)


def test_no_episode_starts_before_the_origin_and_no_draw_is_spent() -> None:
    emu = stragglers(7, p=1.0)  # every step outside an episode starts one
    assert factors(emu, 5, now=BEFORE) == [1.0] * 5
    assert factors(emu, 5, now=-1.0) == [1.0] * 5
    assert factors(emu, 300) == factors(stragglers(7, p=1.0), 300)  # as if it started fresh


@pytest.mark.parametrize(
    ("latency", "bandwidth", "nbytes", "expected"),
    [
        (0.0, None, 10_000, 0.0),  # no emulated link
        (0.002, None, 10_000, 0.002),  # latency alone, whatever the size
        (0.002, None, 0, 0.002),
        (0.0, 1e6, 10_000, 0.01),  # bandwidth alone
        (0.002, 1e6, 10_000, 0.012),  # both: latency + bytes / bandwidth
    ],
)
def test_each_message_pays_latency_plus_bytes_over_bandwidth(
    latency: float, bandwidth: float | None, nbytes: int, expected: float
) -> None:
    emu = Emulation(latency_s=latency, bandwidth=bandwidth)
    assert emu.transfer_seconds(nbytes) == pytest.approx(expected)


# --- the command line -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10:3", (10.0, 3.0)),
        ("0:1", (0.0, 1.0)),
        (" 2.5 : 1.5 ", (2.5, 1.5)),
        ("1e1:2", (10.0, 2.0)),
    ],
)
def test_parse_shift(text: str, expected: tuple[float, float]) -> None:
    assert parse_shift(text) == expected


@pytest.mark.parametrize("text", ["10", "a:2", "1:b", "-1:2", "1:0.5", "inf:2", "1:nan", ":"])
def test_parse_shift_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="shift"):
        parse_shift(text)


def test_parse_origin() -> None:
    assert parse_origin("first-step") == "first-step"
    assert parse_origin("stdin") == "stdin"
    assert parse_origin("1700000000.5") == 1700000000.5
    for bad in ("welcome", "-1", "nan", ""):
        with pytest.raises(ValueError, match="origin"):
            parse_origin(bad)


def args(*flags: str) -> argparse.Namespace:
    return cli.parser().parse_args(["ws://127.0.0.1:1", *flags])


def test_flags_build_the_schedule() -> None:
    emu = cli.build_emulation(
        args(
            "--emulate-slowdown",
            "2",
            "--emulate-shift",
            "5:3",
            "--emulate-shift",
            "1:4",
            "--emulate-stragglers",
            "0.1",
            "--emulate-straggle-factor",
            "2.5",
            "--emulate-straggle-mean",
            "3",
            "--emulate-latency",
            "0.004",
            "--emulate-seed",
            "9",
        )
    )
    assert emu.shifts == ((1.0, 4.0), (5.0, 3.0))
    assert (emu.stragglers, emu.straggle_factor, emu.straggle_mean) == (0.1, 2.5, 3.0)
    assert emu.latency_s == 0.004 and emu.seed == 9
    assert emu.clock is not None and emu.clock.first_step  # the default origin
    old = cli.build_emulation(args("--seed", "9", "--emulate-stragglers", "0.02"))
    assert (old.seed, old.straggle_factor, old.straggle_mean) == (9, 5.0, 10.0)  # old defaults


def test_a_unix_time_origin_on_the_command_line() -> None:
    emu = cli.build_emulation(
        args("--emulate-origin", "1000"), monotonic=lambda: 50.0, wall=lambda: 1003.0
    )
    assert emu.clock is not None and emu.clock.origin == 47.0 and not emu.clock.first_step


def test_the_origin_is_read_from_standard_input() -> None:
    clock = ScheduleClock(lambda: 0.0)
    r, w = os.pipe()
    os.write(w, b"not a time\n12345.5\n")
    os.close(w)
    cli.follow_stdin(clock, r)
    os.close(r)
    assert clock.origin is not None  # the bad line was skipped, the time taken
    clock2 = ScheduleClock(lambda: 0.0)
    r, w = os.pipe()
    os.close(w)
    cli.follow_stdin(clock2, r)  # end of input: no origin, no crash
    os.close(r)
    assert clock2.origin is None


def test_a_joiner_waits_for_the_origin_and_then_for_its_time() -> None:
    now = [100.0]
    emu = cli.build_emulation(
        args("--emulate-origin", "stdin", "--emulate-join-at", "2.5"), monotonic=lambda: now[0]
    )
    assert emu.join_at_s == 2.5 and emu.join_wait_s() is None  # no origin yet: wait for it
    assert emu.clock is not None
    emu.clock.set_origin(101.0)  # t = 0 is a second from now
    assert emu.join_wait_s() == pytest.approx(3.5)
    now[0] = 103.4
    assert emu.join_wait_s() == pytest.approx(0.1)
    now[0] = 200.0
    assert emu.join_wait_s() == 0.0  # past its time: at once (a reconnect never waits again)
    assert Emulation().join_wait_s() == 0.0  # no join time: at once


@pytest.mark.parametrize(
    "flags",
    [
        ["--emulate-shift", "abc"],
        ["--emulate-shift", "3:0.5"],
        ["--emulate-latency", "-1"],
        ["--emulate-latency", "soon"],
        ["--emulate-straggle-factor", "0.5"],
        ["--emulate-straggle-mean", "0"],
        ["--emulate-origin", "yesterday"],
        ["--emulate-stragglers", "1.5"],
        ["--emulate-slowdown", "fast"],
        ["--emulate-join-at", "-2"],
        ["--emulate-join-at", "later"],
        ["--emulate-join-at", "3"],  # from the default origin, the first step: never known
    ],
)
def test_bad_values_get_one_line_and_exit_2(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = cli.main(["ws://127.0.0.1:1", *flags])
    except SystemExit as exc:  # argparse's own type errors
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("hetd-worker: ") and err.count("\n") == 1, err
