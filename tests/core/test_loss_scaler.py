"""LossScaler semantics: growth, back-off, hysteresis, tolerance, static, minimum, state."""

import random

import pytest
import torch

from fairseq_fp16.core.host_sync import HostSyncCounter
from fairseq_fp16.core.loss_scaler import LossScaler, parse_loss_scale
from fairseq_fp16_tools.bench.op_census import OpCensus

CLEAN = torch.tensor(0.0)
OVERFLOW = torch.tensor(1.0)


def run(scaler, pattern):
    """pattern: string of '.' (clean) and 'x' (overflow); returns the scale after each."""
    scales = []
    for c in pattern:
        scaler.update(OVERFLOW if c == "x" else CLEAN)
        scales.append(scaler.loss_scale)
    return scales


def test_grows_after_window_of_clean_updates():
    s = LossScaler(8.0, scale_window=3)
    assert run(s, "......") == [8, 8, 16, 16, 16, 32]


def test_overflow_backs_off_and_restarts_window():
    s = LossScaler(8.0, scale_window=3)
    assert run(s, "..x...") == [8, 8, 4, 4, 4, 8]


def test_hysteresis_absorbs_overflows_before_backing_off():
    # DeepSpeed/Megatron: two overflows absorbed, then each one backs off until growth replenishes
    s = LossScaler(64.0, scale_window=100, hysteresis=3)
    assert run(s, "xxxxxx") == [64, 64, 32, 16, 8, 4]


def test_hysteresis_resets_on_growth():
    s = LossScaler(64.0, scale_window=2, hysteresis=2)
    # one overflow absorbed, then two clean updates grow the scale and reset hysteresis
    assert run(s, "x..x") == [64, 64, 128, 128]


def test_tolerance_needs_fraction_of_overflows():
    s = LossScaler(64.0, scale_window=100, tolerance=0.5)
    # 1/4, then 2/5 overflowed since the last rescale: kept; 3/6 backs off.
    assert run(s, "...x") == [64, 64, 64, 64]
    assert run(s, "xx") == [64, 32]


def test_threshold_is_a_floor_for_back_off():
    s = LossScaler(4.0, scale_window=100, threshold=2.0)
    assert run(s, "xxx") == [2, 2, 2]


def test_static_scale_never_changes_but_counts_overflows():
    s = LossScaler(128.0, dynamic=False)
    assert run(s, "x..x" * 5) == [128.0] * 20
    assert s.num_overflows == 10


def test_min_scale_stops_with_actionable_message():
    s = LossScaler(4.0, scale_window=100, min_scale=1.0)
    run(s, "x")
    s.check_min_scale()  # 2.0 > 1.0: fine
    run(s, "x")
    with pytest.raises(FloatingPointError, match=r"Minimum loss scale reached \(1.0\).*--bf16"):
        s.check_min_scale()


def test_update_costs_no_host_sync():
    s = LossScaler(8.0, scale_window=2, hysteresis=2, tolerance=0.1, threshold=1.0)
    with HostSyncCounter() as c:
        for f in (CLEAN, OVERFLOW, CLEAN, CLEAN, OVERFLOW):
            s.update(f)
            s.scale(torch.ones(()))
    assert c.count == 0


def unfused(scaler):
    scaler._fusable = False  # the general update, kernel by kernel
    return scaler


@pytest.mark.parametrize("init,window,max_scale", [
    (128.0, 3, None), (100.0, 2, None), (3 * 2.0**125, 1, None),  # past the ceiling of 2**127
    (2.0**20, 2, 2.0**24), (2.0**30, 1, 2.0**24),  # bf16's ceiling; a scale above it
])
def test_the_fused_update_moves_every_counter_as_the_general_one(init, window, max_scale):
    """fairseq's default settings take torch's fused scale update; the scale, its counters and the
    state a checkpoint saves follow the general update's, update by update."""
    rng = random.Random(window)
    fused = LossScaler(init, scale_window=window, max_scale=max_scale)
    general = unfused(LossScaler(init, scale_window=window, max_scale=max_scale))
    assert fused._fusable
    for _ in range(200):
        flag = OVERFLOW if rng.random() < 0.3 else CLEAN
        fused.update(flag)
        general.update(flag)
        assert fused.state_dict() == general.state_dict()


def test_the_fused_update_launches_under_half_the_kernels():
    counts = {}
    for name, scaler in (("fused", LossScaler(8.0)), ("general", unfused(LossScaler(8.0)))):
        with OpCensus() as census:
            scaler.update(OVERFLOW)
        counts[name] = census.summary(1)["launches"]
    assert counts["fused"] <= 13 and counts["general"] >= 2 * counts["fused"], counts


@pytest.mark.parametrize("fusable", [True, False], ids=["fused", "general"])
def test_a_checkpoint_of_a_longer_window_grows_at_the_next_multiple_of_the_shorter(fusable):
    """5 clean updates saved under a window of 10, resumed with a window of 3: the next growth
    comes at the 6th clean update since the last overflow, then every 3 (fairseq's scaler grows
    where that count is a multiple of its window)."""
    long_window = LossScaler(8.0, scale_window=10)
    run(long_window, ".....")
    resumed = LossScaler(8.0, scale_window=3)
    resumed._fusable = fusable
    resumed.load_state_dict(long_window.state_dict())
    assert run(resumed, "....") == [16, 16, 16, 32]


def test_state_round_trip_restores_every_counter():
    a = LossScaler(64.0, scale_window=4, hysteresis=2, tolerance=0.0)
    run(a, "..x.x..x")
    b = LossScaler(64.0, scale_window=4, hysteresis=2)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    pattern = "...x..x....x"
    assert run(b, pattern) == run(a, pattern)


def test_static_scaler_keeps_flag_value_over_checkpoint():
    dyn = LossScaler(64.0, scale_window=2)
    run(dyn, "....")
    static = LossScaler(8.0, dynamic=False)
    static.load_state_dict(dyn.state_dict())
    assert static.loss_scale == 8.0


@pytest.mark.parametrize("value,expected", [(None, None), ("0", 0.0), (0, 0.0), ("128", 128.0), (0.5, 0.5), ("1", 1.0)])
def test_parse_loss_scale_accepts(value, expected):
    assert parse_loss_scale(value) == expected


@pytest.mark.parametrize("value", ["-4", "100", "abc", "inf", "nan", -128])
def test_parse_loss_scale_refuses_naming_the_flag(value):
    with pytest.raises(ValueError, match=r"--loss-scale must be 0 \(dynamic\) or a positive power of two"):
        parse_loss_scale(value)


def test_hysteresis_zero_refused():
    with pytest.raises(ValueError, match=r"--loss-scale-hysteresis must be >= 1"):
        LossScaler(hysteresis=0)


@pytest.mark.parametrize("init,max_scale,expected", [
    (8.0, None, 11),  # a power of two: torch's fused update refuses a growth to inf, no ceiling
    (100.0, None, 13),  # another scale is clamped at 2**127 (two launches)
    (8.0, 2.0**24, 13),  # bf16's ceiling
])
def test_the_fused_update_clamps_only_a_scale_that_could_pass_its_ceiling(init, max_scale, expected):
    scaler = LossScaler(init, max_scale=max_scale)
    with OpCensus() as census:
        scaler.update(OVERFLOW)
    assert census.summary(1)["launches"] == expected
    resumed = LossScaler(8.0)
    resumed.load_state_dict(dict(LossScaler(100.0).state_dict()))  # a checkpoint's scale decides
    with OpCensus() as census:
        resumed.update(CLEAN)
    assert census.summary(1)["launches"] == 13
