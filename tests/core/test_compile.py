"""compile_training_forward: the compiled forward serves training calls only, with the eager
module's results."""

import torch

from fairseq_fp16.core.compile import compile_training_forward, is_compiled


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x, incremental_state=None):
        return self.norm(x + torch.relu(self.proj(x)))


def counting_backend():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend, graphs


def test_training_calls_run_the_compiled_forward_with_the_eager_results():
    torch.manual_seed(0)
    layer, reference = Layer(), Layer()
    reference.load_state_dict(layer.state_dict())
    backend, graphs = counting_backend()
    assert compile_training_forward([layer], backend=backend) == 1 and is_compiled(layer)
    x = torch.randn(5, 3, 8)
    torch.testing.assert_close(layer(x), reference(x), rtol=0, atol=0)
    assert len(graphs) == 1
    layer(torch.randn(7, 2, 8))  # another shape: dynamic, no second graph
    assert len(graphs) == 1


def test_eval_and_incremental_calls_run_eagerly():
    layer = Layer()
    backend, graphs = counting_backend()
    compile_training_forward([layer], backend=backend)
    x = torch.randn(4, 2, 8)
    layer(x, incremental_state={})  # fairseq's step-by-step decoding
    layer.eval()
    layer(x)
    assert graphs == []
    layer.train()
    layer(x, incremental_state=None)
    assert len(graphs) == 1


def test_wrapping_twice_is_a_no_op_and_gradients_reach_the_parameters():
    layer = Layer()
    backend, _ = counting_backend()
    assert compile_training_forward([layer, layer], backend=backend) == 1
    assert compile_training_forward([layer], backend=backend) == 0
    layer(torch.randn(3, 2, 8)).sum().backward()
    assert layer.proj.weight.grad is not None and layer.proj.weight.grad.abs().sum() > 0
