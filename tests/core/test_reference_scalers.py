"""LossScaler against the reference scalers it claims to match, as their authors wrote them:
fairseq's DynamicLossScaler (installed here) on random overflow traces, torch's GradScaler update
(CPU) on growth and back-off and across a state round trip, and DeepSpeed/Megatron's hysteresis
as their documentation and code define it."""

import random

import pytest
import torch
from fairseq.optim.dynamic_loss_scaler import DynamicLossScaler

from fairseq_fp16.core.loss_scaler import LossScaler

CLEAN, OVERFLOW = torch.tensor(0.0), torch.tensor(1.0)


def fairseq_step(ref: DynamicLossScaler, overflow: bool) -> str:
    """One update as fairseq's FP16Optimizer drives its scaler: check_overflow on the gradient
    norm (raises on overflow), update() after a clean step."""
    try:
        ref.check_overflow(float("inf") if overflow else 1.0)
    except OverflowError:
        return "skipped"
    except FloatingPointError:
        return "stopped"
    ref.update()
    return "stepped"


def plugin_step(scaler: LossScaler, overflow: bool) -> str:
    scaler.update(OVERFLOW if overflow else CLEAN)
    if not overflow:
        return "stepped"
    try:
        scaler.check_min_scale()
    except FloatingPointError:
        return "stopped"
    return "skipped"


SETTINGS = [(tol, window, threshold, min_scale)
            for tol in (0.0, 0.25, 0.5, 1.0)
            for window in (1, 2, 3, 7)
            for threshold in (None, 2.0)
            for min_scale in (1e-4, 1.0)]


@pytest.mark.parametrize("tolerance,window,threshold,min_scale", SETTINGS)
def test_random_traces_match_fairseqs_dynamic_loss_scaler(tolerance, window, threshold, min_scale):
    rng = random.Random(hash((tolerance, window, threshold, min_scale)) & 0xFFFF)
    for trace in range(13):
        p_overflow = rng.choice([0.05, 0.2, 0.5, 0.8])
        init = 2.0 ** rng.randint(0, 10)
        ref = DynamicLossScaler(init, scale_window=window, tolerance=tolerance, threshold=threshold,
                                min_loss_scale=min_scale)
        ours = LossScaler(init, scale_window=window, tolerance=tolerance, threshold=threshold,
                          min_scale=min_scale)
        for update in range(60):
            overflow = rng.random() < p_overflow
            a, b = fairseq_step(ref, overflow), plugin_step(ours, overflow)
            assert (a, ref.loss_scale) == (b, ours.loss_scale), (trace, update)
            if a == "stopped":
                break


def test_a_growth_does_not_forget_the_overflows_counted_for_the_tolerance():
    # fairseq resets the overflow count only when it backs off: tolerance 0.75, window 2, trace
    # ".x...x": the first overflow is tolerated (1 of 2 updates), the scale grows at the fourth
    # update, and the second overflow (2 overflows over 2 updates since that growth) backs off
    ref = DynamicLossScaler(8.0, scale_window=2, tolerance=0.75)
    ours = LossScaler(8.0, scale_window=2, tolerance=0.75)
    got = [(fairseq_step(ref, c == "x"), ref.loss_scale, plugin_step(ours, c == "x"), ours.loss_scale)
           for c in ".x...x"]
    assert [(a, s) for a, s, _, _ in got] == [(b, t) for _, _, b, t in got]
    assert [s for _, s, _, _ in got] == [8.0, 8.0, 8.0, 16.0, 16.0, 8.0]


def test_at_the_minimum_the_scale_before_the_back_off_is_kept():
    ours = LossScaler(2.0, scale_window=100, min_scale=1.0)
    ref = DynamicLossScaler(2.0, scale_window=100, min_loss_scale=1.0)
    assert plugin_step(ours, True) == fairseq_step(ref, True) == "stopped"
    assert ours.loss_scale == ref.loss_scale == 2.0


def grad_scaler_update(scale, tracker, found_inf, window):
    """torch.amp.GradScaler.update's arithmetic (its CPU kernel)."""
    torch._amp_update_scale_(scale, tracker, found_inf, 2.0, 0.5, window)


@pytest.mark.parametrize("window", [1, 2, 5])
def test_growth_and_back_off_match_torchs_grad_scaler(window):
    rng = random.Random(window)
    scale, tracker = torch.tensor(2.0**16), torch.tensor(0, dtype=torch.int32)
    ours = LossScaler(2.0**16, scale_window=window)
    for _ in range(300):
        found_inf = torch.tensor(1.0 if rng.random() < 0.3 else 0.0)
        grad_scaler_update(scale, tracker, found_inf, window)
        ours.update(found_inf)
        assert ours.loss_scale == float(scale)
    assert ours.state_dict()["clean_steps"] == int(tracker)


def test_a_state_round_trip_continues_as_grad_scaler_continues():
    rng = random.Random(7)
    flags = [torch.tensor(1.0 if rng.random() < 0.3 else 0.0) for _ in range(200)]
    scale, tracker = torch.tensor(1024.0), torch.tensor(0, dtype=torch.int32)
    ours = LossScaler(1024.0, scale_window=3)
    for f in flags[:100]:
        grad_scaler_update(scale, tracker, f, 3)
        ours.update(f)
    resumed = LossScaler(1.0, scale_window=3)
    resumed.load_state_dict(ours.state_dict())
    for f in flags[100:]:
        grad_scaler_update(scale, tracker, f, 3)
        resumed.update(f)
        assert resumed.loss_scale == float(scale)


def test_hysteresis_is_replenished_by_growth_as_in_deepspeed_and_megatron():
    # Megatron's DynamicGradScaler: the hysteresis tracker falls by one per overflow, the scale
    # backs off once it reaches 0, and only growth sets it back (DeepSpeed's delayed_shift the
    # same without consecutive_hysteresis). With hysteresis 2, five octaves down take 6 skipped
    # updates: 2 for the first, 1 each after.
    s = LossScaler(2.0**10, scale_window=1000, hysteresis=2)
    skipped = 0
    while s.loss_scale > 2.0**5:
        s.update(OVERFLOW)
        skipped += 1
    assert skipped == 6
    # growth replenishes: after a window of clean updates one overflow is absorbed again
    s2 = LossScaler(64.0, scale_window=2, hysteresis=2)
    for flag in (OVERFLOW, OVERFLOW, CLEAN, CLEAN, OVERFLOW):
        s2.update(flag)
    assert s2.loss_scale == 64.0  # 64 -> 32 (second overflow) -> 64 (growth) -> kept (absorbed)


def test_a_bf16_scale_never_grows_past_its_ceiling():
    s = LossScaler(2.0**20, scale_window=1, max_scale=2.0**24)
    for _ in range(10):
        s.update(CLEAN)
    assert s.loss_scale == 2.0**24
    unbounded = LossScaler(2.0**120, scale_window=1)
    for _ in range(20):
        unbounded.update(CLEAN)
    assert unbounded.loss_scale == 2.0**127  # never inf


@pytest.mark.parametrize("tolerance", [0.0, 0.25], ids=["fused", "general"])
@pytest.mark.parametrize("windows", [(16, 4), (4, 16), (7, 3)])
def test_a_window_changed_mid_run_moves_the_scale_as_fairseqs_scaler(tolerance, windows):
    """A per-epoch --update-freq changes the window in the run (the trainer patch's begin_epoch):
    the scale follows fairseq's DynamicLossScaler with its window changed at the same update,
    also where the clean count is already past the new window (16 -> 4 after 10 clean updates
    left the fused update's count past 4 for good: the scale never grew again)."""
    rng = random.Random(sum(windows))
    for trace in range(20):
        first, second = windows
        ref = DynamicLossScaler(128.0, scale_window=first, tolerance=tolerance)
        ours = LossScaler(128.0, scale_window=first, tolerance=tolerance)
        change = rng.randint(5, 30)
        p_overflow = rng.choice([0.0, 0.02, 0.1])
        for update in range(60):
            if update == change:
                ref.scale_window = ours.scale_window = second
            overflow = 10 <= update < change and rng.random() < p_overflow
            a, b = fairseq_step(ref, overflow), plugin_step(ours, overflow)
            assert (a, ref.loss_scale) == (b, ours.loss_scale), (trace, update)


def test_the_window_16_to_4_case_grows_as_fairseq():
    ref = DynamicLossScaler(128.0, scale_window=16)
    ours = LossScaler(128.0, scale_window=16)
    for update in range(50):
        if update == 10:
            ref.scale_window = ours.scale_window = 4
        fairseq_step(ref, False)
        plugin_step(ours, False)
    assert ours.loss_scale == ref.loss_scale == 128.0 * 2 ** 10  # growths at 12, 16, ..., 48
