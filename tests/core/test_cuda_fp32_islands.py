"""On a CUDA device: a LayerNorm island computes what the fp32 island computes, and skips its
casts where torch's CUDA layer_norm takes fp32 weights with a half input. Skipped where torch
sees no GPU (CI); run on a GPU machine with ``pytest -m gpu``."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fairseq_fp16.core.fp32_islands import direct_half_layer_norm, keep_in_fp32, within_one_ulp

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEV = torch.device("cuda")
HALF = [torch.float16, torch.bfloat16]


class Casts(TorchDispatchMode):
    """Counts the dtype conversions run inside it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] == "_to_copy":
            self.count += 1
        return func(*args, **(kwargs or {}))


def island_and_data(dtype):
    torch.manual_seed(0)
    island = keep_in_fp32(nn.LayerNorm(512))
    with torch.no_grad():
        island.weight.normal_(1.0, 0.5)
        island.bias.normal_()
    island.to(DEV, dtype)
    x = (torch.randn(4096, 512) * 3 + 1).to(DEV, dtype)
    dy = torch.randn(4096, 512).to(DEV, dtype)
    return island, x, dy


@pytest.mark.parametrize("dtype", HALF)
def test_a_layer_norm_island_on_cuda_computes_what_the_fp32_island_computes(dtype):
    """Whichever path the probe chose: outputs and input gradients within one ulp of the fp32
    island's (the same bits where the casts stay), weight and bias gradients fp32 sums."""
    island, x, dy = island_and_data(dtype)
    xi = x.clone().requires_grad_()
    y = island(xi)
    y.backward(dy)
    xr = x.clone().requires_grad_()
    w, b = (p.detach().clone().requires_grad_() for p in (island.weight, island.bias))
    ref = F.layer_norm(xr.float(), (512,), w, b).to(dtype)
    ref.backward(dy)
    assert y.dtype == dtype and island.weight.grad.dtype == torch.float32
    if direct_half_layer_norm(DEV, dtype):
        assert within_one_ulp(y, ref, dtype) and within_one_ulp(xi.grad, xr.grad, dtype)
    else:
        assert torch.equal(y, ref) and torch.equal(xi.grad, xr.grad)
    for got, want in ((island.weight.grad, w.grad), (island.bias.grad, b.grad)):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("dtype", HALF)
def test_where_torchs_cuda_kernel_takes_fp32_weights_the_island_launches_no_casts(dtype):
    island, x, dy = island_and_data(dtype)
    try:
        F.layer_norm(x, (512,), island.weight, island.bias)
    except RuntimeError as e:
        assert not direct_half_layer_norm(DEV, dtype)
        pytest.skip(f"torch {torch.__version__}'s CUDA layer_norm refuses fp32 weights with a "
                    f"{dtype} input ({e}): the island keeps its casts")
    if not direct_half_layer_norm(DEV, dtype):
        pytest.skip(f"torch {torch.__version__}'s CUDA layer_norm takes fp32 weights with a {dtype} "
                    "input but does not compute as the island does: the island keeps its casts")
    xi = x.clone().requires_grad_()
    with Casts() as casts:
        island(xi).backward(dy)
    assert casts.count == 0
