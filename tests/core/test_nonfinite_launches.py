"""What the overflow diagnostics launch: an armed non-finite watch and the attribution of an
overflow cost a few multi-tensor launches, not one or six per module output or gradient
(counted with the op census, as a CUDA run would launch them)."""

import pytest
import torch
from torch import nn

from fairseq_fp16.core.diagnostics import NonFiniteWatch, attribute_overflow
from fairseq_fp16.core.host_sync import HostSyncCounter
from fairseq_fp16.core.param_names import tag_param_names
from fairseq_fp16_tools.bench.op_census import OpCensus


def blocks(n: int = 2, depth: int = 10) -> nn.Module:
    """``n`` children of ``depth`` Linear + ReLU pairs: 40 module outputs for n=2."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(*(m for _ in range(depth) for m in (nn.Linear(8, 8), nn.ReLU())))
                           for _ in range(n)))


def launches(fn) -> int:
    with OpCensus() as census:
        fn()
    return census.summary(1)["launches"]


def test_an_armed_forward_reduces_its_module_outputs_in_two_launches_per_child():
    model = blocks()
    x = torch.ones(3, 8)
    disarmed = launches(lambda: model(x))
    watch = NonFiniteWatch(model)
    watch.arm()
    # each child of the model: one inf-norm over its outputs and one stack of the peaks
    assert launches(lambda: model(x)) == disarmed + 4
    with torch.no_grad():
        model[1][4].bias[0] = float("inf")  # the third Linear of the second child
    with HostSyncCounter() as syncs:
        model(x)
    assert syncs.count == 0
    with HostSyncCounter() as syncs:
        first = watch.first
    assert syncs.count == 1
    assert first == {"module": "1.4", "type": "Linear", "dtype": "float32", "kind": "inf", "shape": [3, 8]}


def named_half_params(n: int):
    params = {f"layers.{i}.weight": nn.Parameter(torch.zeros(50).half()) for i in range(n)}
    tag_param_names(params.items())
    return list(params.values())


@pytest.mark.parametrize("overflowed", [1, 20, 40])
def test_attributing_an_overflow_costs_seven_launches_however_many_gradients_overflowed(overflowed):
    params = named_half_params(40)
    for i, p in enumerate(params):
        p.grad = torch.ones_like(p)
        if i < overflowed:
            p.grad[: i + 1] = float("inf") if i % 2 else float("nan")
    with OpCensus() as census:
        hits = attribute_overflow(params)
    # peaks: an inf-norm and a stack; counts: g * 0, its copy to bool and back, a 1-norm, a stack
    assert census.summary(1)["launches"] == 7
    expected = sorted(range(overflowed), key=lambda i: (-(i + 1), f"layers.{i}.weight"))[:5]
    assert hits == [{"param": f"layers.{i}.weight", "nonfinite": i + 1, "numel": 50} for i in expected]
