"""scripts/bench_optimizer.py: the fixed cost of a step, against torch's own AdamW step."""

import torch

from fairseq_fp16_tools.bench.optimizer import fixed_cost, timed_in_turn


def test_fixed_cost_counts_the_launches_and_times_torch_step_in_the_same_run():
    out = fixed_cost(torch.device("cpu"), steps=5, count=20, size=4)
    assert (out["tensors"], out["params"]) == (20, 80)
    # the norm and overflow check, the gradient copy, the fused AdamW, the weights copied back and
    # the scaler's update: the launches do not grow with the tensors (foreach kernels take lists)
    assert out["launches"] == 30
    assert out["step_ms"] > 0 and out["torch_step_ms"] > 0


def test_the_steps_compared_are_timed_in_turn():
    calls = []
    ms = timed_in_turn({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3,
                       torch.device("cpu"))
    assert calls == ["a", "b"] * 4  # one warm-up call each, then three rounds
    assert set(ms) == {"a", "b"} and all(v >= 0 for v in ms.values())
