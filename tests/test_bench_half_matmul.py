"""scripts/bench_half_matmul.py --products: the weight-gradient variant computes the same product."""

import pytest
import torch

from fairseq_fp16_tools.bench.half_matmul import narrow_side_first


@pytest.mark.parametrize("out, inp", [(48, 16), (16, 48), (16, 16)])  # b the narrower, a the narrower, square
def test_narrow_side_first_is_the_weight_gradient_product(out, inp):
    torch.manual_seed(0)
    grad, x = torch.randn(64, out, dtype=torch.float64), torch.randn(64, inp, dtype=torch.float64)
    a = grad.t()  # a weight gradient's left operand: the output gradient, a transposed view
    got = narrow_side_first(a, x)
    assert got.shape == (out, inp)
    torch.testing.assert_close(got, a @ x, rtol=1e-12, atol=1e-12)
