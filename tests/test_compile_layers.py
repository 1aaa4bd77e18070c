"""--compile-layers in a real fairseq-train run: one set of graphs serves every batch length and
every layer of a kind; with --length-buckets and --cuda-graphs (torch.compile's reduce-overhead
mode) the layers see a few batch shapes and train as the eager run does."""

import copy
import os
import re
import subprocess
import sys

import pytest

from conftest import TRAIN, USER_DIR

MODEL = ["--arch", "transformer", "--encoder-layers", "2", "--decoder-layers", "3",
         "--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
         "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2",
         "--decoder-attention-heads", "2", "--share-all-embeddings"]


@pytest.mark.slow
@pytest.mark.parametrize("precision", [
    [], ["--fp16", "--half-matmul", "fp32-accumulate", "--fp16-init-scale", "1048576"]],
    ids=["fp32", "fp16-fp32acc-overflows"])
def test_compiled_layers_do_not_recompile_per_batch_length_or_layer(toy_data, tmp_path, precision):
    """The first encoder layer gets a transposed view and the others contiguous tensors; before
    the compiled forward took contiguous inputs, every new batch length recompiled and after 8
    the layers ran eagerly for the rest of the run. Each decoder layer's attention has its own
    random incremental-state id; before the lookup stopped reading it without a state, each
    decoder layer compiled graphs of its own. A CPU half run under fp32 accumulation checks its
    first step's products under a dispatch mode; before the layers ran that step eagerly, they
    were never compiled at all. Its first updates overflow (the scale starts at 2**20) and arm
    the non-finite watch; before the armed watch held the layers to their own forward, each
    arming's hooks recompiled them."""
    cmd = [sys.executable, "-m", "fairseq_cli.train", str(toy_data), *MODEL, *TRAIN,
           "--user-dir", USER_DIR, "--save-dir", str(tmp_path), "--no-save", "--compile-layers",
           "--fused-loss", "on", *precision,
           "--max-update", "30", "--disable-validation"]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "TORCH_LOGS": "recompiles"})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "the training forward of 5 transformer layers is compiled" in log
    assert "recompile_limit" not in log
    assert "in fp32 chunks (the compiled path)" in log  # compiled layers take the compiled loss
    lengths = set(re.findall(r"train_inner.*?\"wpb\": \"?([0-9.]+)", log))
    assert len(lengths) > 8  # batches of more sizes than torch's limit of recompiles (8)
    recompiles = re.findall(r"Recompiling function forward in \S+transformer_layer\.py:(\d+)", log)
    # the variants only: padding masks present or None, and the decoder's last layer's attention
    assert "_incremental_state_id" not in log and "_forward_hooks" not in log
    if precision:
        assert int(re.findall(r'"skipped": "([0-9]+)"', log)[-1]) >= 5  # the watch was armed
    assert 1 <= len(recompiles) <= 6, recompiles  # 0: the layers were never compiled



def _record_updates(log):
    """An ``on_load`` hook (tests/inprocess.py) that appends, for each update, the batch's shape
    and padding variant, the frames torch.compile compiled during it, and its loss per target
    token (unrounded: the task's own)."""
    from torch._dynamo.utils import counters

    def on_load(trainer, extra_state):
        task = trainer.task
        step, pad = task.train_step, task.source_dictionary.pad()

        def train_step(sample, *args, **kwargs):
            net = sample["net_input"]
            key = (tuple(net["src_tokens"].shape), tuple(net["prev_output_tokens"].shape),
                   bool(net["src_tokens"].eq(pad).any()), bool(net["prev_output_tokens"].eq(pad).any()))
            before = counters["frames"]["ok"]
            loss, sample_size, logging_output = step(sample, *args, **kwargs)
            log.append((key, counters["frames"]["ok"] - before, float(loss) / sample_size))
            return loss, sample_size, logging_output

        task.train_step = train_step

    return on_load


@pytest.mark.slow
def test_bucketed_graphs_compile_once_and_train_as_the_eager_run(toy_data, tmp_path, monkeypatch):
    """--length-buckets 3 --compile-layers --cuda-graphs, in this process: the layers see at most
    3 batch shapes, so a GPU records at most 3 graph sets a padding variant; torch.compile
    compiles only in an update whose batch shape or padding variant is new and never again for
    one seen (one compiled set serves every bucket); the losses are the eager bucketed run's,
    update for update, up to rounding. torch.compile's graphs are made by AOTAutograd without
    inductor's code generation here (seconds, where inductor's C++ compiler takes minutes on a
    small CPU); dynamo's graphs, guards and recompiles are the same, and the next test runs
    inductor's reduce-overhead mode itself."""
    import torch._dynamo
    from inprocess import fairseq_train

    from conftest import TINY_MODEL
    from fairseq_fp16.core.compile import compile_training_forward
    from fairseq_fp16 import features

    used = []

    def aot_eager(layers, **kwargs):
        used.append(kwargs.get("mode"))
        return compile_training_forward(layers, backend="aot_eager", **kwargs)

    monkeypatch.setattr(features, "compile_training_forward", aot_eager)
    common = [toy_data, *[a if a != "0.1" else "0" for a in TINY_MODEL], *TRAIN, "--user-dir", USER_DIR,
              "--no-save", "--disable-validation", "--train-subset", "valid", "--length-buckets", "3",
              "--max-update", "12"]
    runs = {}
    for name, flags in (("eager", []), ("graphs", ["--compile-layers", "--cuda-graphs"])):
        torch._dynamo.reset()  # compile from scratch, whatever this process compiled before
        runs[name] = []
        fairseq_train([*common, "--save-dir", tmp_path / name, *flags], on_load=_record_updates(runs[name]))
    eager, graphs = runs["eager"], runs["graphs"]
    assert used == ["reduce-overhead"]
    assert [k for k, _, _ in graphs] == [k for k, _, _ in eager] and len(graphs) == 12
    shapes = {k[:2] for k, _, _ in graphs}
    assert len(shapes) <= 3 and len(graphs) >= 3 * len(shapes)  # each bucket trained on again and again
    seen = set()
    for key, compiled, _ in graphs:
        assert compiled == 0 or key not in seen, (key, graphs)
        seen.add(key)
    assert sum(c for _, c, _ in graphs) >= 2  # the encoder and the decoder layer were compiled
    assert sum(c for _, c, _ in eager) == 0
    torch.testing.assert_close([loss for *_, loss in graphs], [loss for *_, loss in eager], rtol=1e-5, atol=0)


def test_reduce_overhead_runs_compiled_on_the_cpu_once_for_every_shape():
    """compile_training_forward(mode="reduce-overhead"), --cuda-graphs' mode, with inductor: on
    the CPU torch skips the graphs and runs the compiled code, compiled once for batches of two
    bucket shapes, with eager's outputs and gradients up to rounding; in eval mode the module's
    own forward runs."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    from fairseq_fp16.core.compile import compile_training_forward

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16),
                                torch.nn.LayerNorm(16))
    reference = copy.deepcopy(block)
    torch._dynamo.reset()
    assert compile_training_forward([block], mode="reduce-overhead") == 1
    before = counters["frames"]["ok"]
    for shape in [(24, 13), (32, 10), (24, 13), (32, 10)]:  # (sentences, length) of two buckets
        x = torch.randn(*shape, 16)
        out, ref = block(x), reference(x)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        out.square().sum().backward()
        ref.square().sum().backward()
    for p, q in zip(block.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)
    assert counters["frames"]["ok"] - before == 1
    assert counters["inductor"]["cudagraph_skips"] >= 1  # the graphs skipped: not on CUDA
    block.eval()
    with torch.no_grad():
        x = torch.randn(5, 3, 16)
        assert torch.equal(block(x), reference.eval()(x))  # eval: the module's own forward
    assert counters["frames"]["ok"] - before == 1
