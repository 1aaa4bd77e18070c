"""compile_training_forward: the compiled forward serves training calls only, with the eager
module's results."""

import pytest
import torch

from fairseq_fp16.core.compile import compile_training_forward, hold_eager, is_compiled


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x, incremental_state=None, variant=""):
        out = self.norm(x + torch.relu(self.proj(x)))
        return out * len(variant) if variant else out  # a graph per variant


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


def test_one_graph_serves_transposed_and_contiguous_inputs_of_any_length():
    """A transformer's first layer gets a transposed view, the others contiguous tensors, and the
    decoder a causal mask cut from a cached one: each stride pattern would be a new graph, and
    past torch's recompile limit the layer would silently run eagerly."""
    layer, backend_graphs = Layer(), counting_backend()
    backend, graphs = backend_graphs
    compile_training_forward([layer], backend=backend)
    cached_mask = torch.zeros(64, 64)
    for batch, length in [(3, 5), (2, 9), (4, 7), (5, 11)]:
        embedded = torch.randn(batch, length, 8, requires_grad=True)  # as embeddings are
        x = embedded.transpose(0, 1)  # time-major view: strides follow the length
        out = layer(x)
        layer(out)  # the next layer: contiguous
        layer(cached_mask[:length, :8].expand(batch, length, 8).transpose(0, 1).requires_grad_())
    assert len(graphs) == 1


def test_more_variants_than_torchs_default_limit_stay_compiled():
    """A fairseq decoder layer has up to eight variants (attention weights asked for or not,
    padding masks or None); past torch's limit of 8 a forward would fall back to eager."""
    layer = Layer()
    backend, graphs = counting_backend()
    compile_training_forward([layer], backend=backend)
    x = torch.randn(3, 2, 8, requires_grad=True)
    for variant in range(12):
        layer(x, variant="v" * variant)
    assert len(graphs) == 12


def test_a_call_under_a_dispatch_mode_runs_eagerly_and_later_calls_compile():
    """torch.compile compiles nothing under a Python dispatch mode (the plugin's first-step
    check of the CPU's half products is one) and ran the frame eagerly from then on: the
    layers of such a run were never compiled."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    layer = Layer()
    backend, graphs = counting_backend()
    compile_training_forward([layer], backend=backend)
    x = torch.randn(4, 2, 8)
    with Passthrough():
        eager = layer(x)
    assert graphs == []
    torch.testing.assert_close(layer(x), eager, rtol=0, atol=0)
    assert len(graphs) == 1


def test_an_armed_non_finite_watch_holds_compiled_layers_to_their_own_forward():
    """The watch's hooks on the layers' modules would be guarded by a compiled graph, every
    arming's new hooks a recompile; armed, the layers run eagerly and the hooks name the module,
    and disarmed, the one compiled graph serves again."""
    from fairseq_fp16.core.diagnostics import NonFiniteWatch

    layer = Layer()
    backend, graphs = counting_backend()
    compile_training_forward([layer], backend=backend)
    x = torch.randn(4, 2, 8)
    layer(x)
    watch = NonFiniteWatch(layer)
    for _ in range(3):
        watch.arm()
        layer(torch.full((4, 2, 8), float("inf")))
        assert watch.first["module"] == "proj"
        watch.disarm()
        layer(x)
    assert len(graphs) == 1


def test_a_watch_left_armed_holds_only_its_own_model():
    """A run that stops on overflows leaves its watch armed, kept alive by the hooks' reference
    cycle until the garbage collector runs: another model's compiled layers in that process
    compile and run compiled all the same."""
    import gc

    from fairseq_fp16.core.diagnostics import NonFiniteWatch

    gc.disable()  # the cycle stays, as it does between two collections
    try:
        stopped = Layer()
        compile_training_forward([stopped], backend=counting_backend()[0])
        NonFiniteWatch(stopped).arm()  # dropped armed
        layer = Layer()
        backend, graphs = counting_backend()
        compile_training_forward([layer], backend=backend)
        layer(torch.randn(4, 2, 8))
        assert len(graphs) == 1
    finally:
        gc.enable()


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_deep_copy_runs_its_own_weights_compiled_and_eagerly(checkpointed):
    # fairseq's EMA deep-copies the model: the copy's layers must compute with the copy's weights
    # (checkpointed: --checkpoint-activations gives each layer an instance forward of its own)
    import copy

    from fairseq.modules.checkpoint_activations import checkpoint_wrapper

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(checkpoint_wrapper(Layer()) if checkpointed else Layer() for _ in range(2)))
    backend, graphs = counting_backend()
    compile_training_forward(list(model), backend=backend)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    reference = torch.nn.Sequential(Layer(), Layer())
    reference.load_state_dict(twin.state_dict())
    x = torch.randn(5, 3, 8)
    assert all(is_compiled(m) for m in twin) and all(is_compiled(m) for m in model)
    for mode in (True, False):  # training: compiled; eval: the module's own forward
        twin.train(mode), reference.train(mode), model.train(mode)
        torch.testing.assert_close(twin(x), reference(x), rtol=0, atol=0)
        assert not torch.equal(model(x), twin(x))
    assert len(graphs) >= 1
    holder = Layer()  # what holds the copy: the original's layers stay free of it
    hold_eager(holder, twin)
    assert all(len(m._fairseq_fp16_compiled) == 1 for m in twin)
    assert all(len(m._fairseq_fp16_compiled) == 0 for m in model)


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one thread: nothing to spread over")
def test_a_kernel_first_compiled_on_a_small_tensor_still_runs_on_every_thread():
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    from fairseq_fp16.core.compile import compile_dynamic

    def scaled(x):
        return (x.float() * 3.0 + 1.0).to(x.dtype)

    small = torch.randn(100).to(torch.bfloat16)  # under inductor's size for a parallel loop
    with config.patch(force_disable_caches=True):
        _, plain = run_and_get_code(torch.compile(scaled, dynamic=True), small)
        out, code = run_and_get_code(compile_dynamic(scaled), small)
    assert not any("#pragma omp parallel" in c for c in plain)  # torch's default: one thread
    assert code and all("#pragma omp parallel" in c for c in code)
    torch.testing.assert_close(out, scaled(small), rtol=0, atol=0)
