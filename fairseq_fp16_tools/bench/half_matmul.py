"""ms per training step of one transformer in fp32, native fp16/bf16 and fp32-accumulate fp16/bf16.

    python scripts/bench_half_matmul.py [--layers 3 --dim 256 --batch 32 --seq 40 --steps 5]

Same model (LayerNorms kept fp32 as in the plugin), same batch, forward + backward,
in one process. fp32 accumulation runs twice: through the function mode
``--half-matmul`` uses (``fp32-accumulate``) and through the dispatch mode alone
(``fp32-accumulate dispatch``: a Python call on every aten op), same numbers (but for
RNNs, which the function mode runs in fp32 inside, as cuDNN does).
The variants run interleaved for --rounds rounds and each reports
the median of its per-step times, so a noisy machine shifts all of them alike.
Prints a table and, as its last line, one JSON object with the ms/step of each
variant and its ratio to fp32. ``--fairseq`` times fairseq's encoder-decoder
transformer instead (--layers each side, FFN 2 x --dim, shared 8,000-word
embeddings, a cross-entropy loss on --batch x --seq target tokens), half models
on fairseq's own attention path as translation_fp16 builds them: the plugin's
real products; ``--fconv`` times fairseq's convolutional model (its ConvTBC
convolutions are routed too), ``--lstm`` its LSTM model (an ``nn.LSTM`` encoder, a
decoder stepping ``nn.LSTMCell``s with attention). Native fp16 on a CPU without fp16 units is very
slow: it runs --slow-steps steps per round only.

``--products`` times the matrix products alone instead (a transformer base layer's at 4,096
tokens: the projections 4096x512 by 512x512, FFN 4096x512 by 512x2048 and 4096x2048 by
2048x512, and the weight gradients of those three, out x 4096 (transposed) by 4096 x in), in
TFLOP/s per kernel choice: fp32, native bf16 and fp16, fp32 accumulation (the half operands
upcast, an fp32 product, the result rounded to half), and for the weight gradients native bf16
with the narrower operand copied row-major first, with the ``machine`` and the ``provenance``
in the JSON.
"""

import argparse
import contextlib
import json
import statistics
import time

import torch

from fairseq_fp16.core.fp32_islands import apply_fp32_islands
from fairseq_fp16.core.half_matmul import Fp32AccumulateMatmul, cpu_has_native_half, half_matmul_context

#: each variant's context: False none, True the function mode --half-matmul uses, "dispatch" the dispatch mode
CONTEXTS = {False: contextlib.nullcontext, True: lambda: half_matmul_context(True),
            "dispatch": Fp32AccumulateMatmul}


def build(layers, dim, seed=0):
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, dropout=0.0,
                                             batch_first=True)
    return torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def fairseq_task(vocab):
    """What a fairseq model's build_model reads of its task: one shared dictionary of vocab words."""
    from argparse import Namespace

    from fairseq.data import Dictionary

    words = Dictionary()
    for i in range(vocab - len(words)):
        words.add_symbol(f"w{i}")
    return Namespace(source_dictionary=words, target_dictionary=words)


def build_fairseq(layers, dim, vocab=8000, seed=0):
    from argparse import Namespace

    from fairseq.models.transformer import TransformerModel, transformer_legacy

    args = Namespace(arch="transformer", encoder_layers=layers, decoder_layers=layers,
                     encoder_embed_dim=dim, decoder_embed_dim=dim, encoder_ffn_embed_dim=2 * dim,
                     decoder_ffn_embed_dim=2 * dim, encoder_attention_heads=4, decoder_attention_heads=4,
                     share_all_embeddings=True, dropout=0.0, encoder_normalize_before=True,
                     decoder_normalize_before=True)
    transformer_legacy.base_architecture(args)
    torch.manual_seed(seed)
    return TransformerModel.build_model(args, fairseq_task(vocab))


def build_fconv(layers, dim, vocab=8000, seed=0):
    """fairseq's convolutional seq2seq (fconv): ConvTBC layers of kernel 3 with GLU, attention."""
    from argparse import Namespace

    from fairseq.models.fconv import FConvModel, base_architecture

    convs = f"[({dim}, 3)] * {layers}"
    args = Namespace(arch="fconv", encoder_embed_dim=dim, decoder_embed_dim=dim, decoder_out_embed_dim=dim,
                     encoder_layers=convs, decoder_layers=convs, dropout=0.0,
                     max_source_positions=1024, max_target_positions=1024)
    base_architecture(args)
    torch.manual_seed(seed)
    return FConvModel.build_model(args, fairseq_task(vocab))


def build_lstm(layers, dim, vocab=8000, seed=0):
    """fairseq's LSTM seq2seq: nn.LSTM encoder, LSTMCell decoder with attention, hidden size dim."""
    from argparse import Namespace

    from fairseq.models.lstm import LSTMModel, base_architecture

    args = Namespace(arch="lstm", encoder_embed_dim=dim, encoder_hidden_size=dim, encoder_layers=layers,
                     decoder_embed_dim=dim, decoder_hidden_size=dim, decoder_out_embed_dim=dim,
                     decoder_layers=layers, dropout=0.0, max_source_positions=1024, max_target_positions=1024,
                     criterion="cross_entropy")
    base_architecture(args)
    torch.manual_seed(seed)
    return LSTMModel.build_model(args, fairseq_task(vocab))


BUILDERS = {"fairseq": build_fairseq, "fconv": build_fconv, "lstm": build_lstm}


def loss_of(model, x):
    if isinstance(x, tuple):  # fairseq: (source, target) token ids
        src, tgt = x
        logits, _ = model(src, torch.full((src.size(0),), src.size(1)), tgt)
        return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt.view(-1))
    return model(x).float().pow(2).mean()


def time_steps(model, x, steps, accumulate):
    """Per-step times in ms (after one warm-up step)."""

    def step():
        with CONTEXTS[accumulate]():
            loss_of(model, x).backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1000)
    return times


#: (m, k, n) of transformer base's products at 4,096 tokens
PRODUCT_SHAPES = ((4096, 512, 512), (4096, 512, 2048), (4096, 2048, 512))
#: and the weight gradients of a projection and of the FFN's two layers: the tokens are the sum,
#: the left operand the output gradient transposed (a view of a row-major 4096 x out tensor), as
#: a linear layer's backward pass multiplies them
WEIGHT_GRADIENTS = ((512, 4096, 512), (2048, 4096, 512), (512, 4096, 2048))


def narrow_side_first(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for a weight gradient (``a`` a transposed view): the narrower operand copied
    row-major first, the product then of two row-major operands (of the transposes, where
    ``b`` is the narrower: ``(b^T a^T)^T``)."""
    if a.shape[0] > b.shape[1]:
        return (b.t().contiguous() @ a.t()).t()
    return a.contiguous() @ b


def product_throughput(repeats: int) -> dict:
    """TFLOP/s of each kernel choice on :data:`PRODUCT_SHAPES` and :data:`WEIGHT_GRADIENTS`
    (medians of ``repeats``); ``bf16 native, narrow side first`` on the weight gradients only."""
    both = PRODUCT_SHAPES + WEIGHT_GRADIENTS
    choices = {
        "fp32": (torch.float32, lambda a, b: a @ b, both),
        "bf16 native": (torch.bfloat16, lambda a, b: a @ b, both),
        "bf16 native, narrow side first": (torch.bfloat16, narrow_side_first, WEIGHT_GRADIENTS),
        "bf16 fp32-accumulate": (torch.bfloat16, lambda a, b: (a.float() @ b.float()).to(a.dtype), both),
        "fp16 native": (torch.float16, lambda a, b: a @ b, both),
        "fp16 fp32-accumulate": (torch.float16, lambda a, b: (a.float() @ b.float()).to(a.dtype), both),
    }
    out = {}
    for name, (dtype, product, shapes) in choices.items():
        slow = "native" in name and not cpu_has_native_half(dtype)
        rows = {}
        for m, k, n in shapes:
            wgrad = (m, k, n) in WEIGHT_GRADIENTS
            a = torch.randn(k, m).to(dtype).t() if wgrad else torch.randn(m, k).to(dtype)
            b = torch.randn(k, n).to(dtype)
            product(a, b)  # warm-up (oneDNN builds its kernel)
            times = []
            for _ in range(1 if slow else repeats):
                t0 = time.perf_counter()
                product(a, b)
                times.append(time.perf_counter() - t0)
            key = f"{m}x{k}x{n}" + (" wgrad" if wgrad else "")
            rows[key] = round(2 * m * k * n / statistics.median(times) / 1e12, 3)
        out[name] = rows
    return out


def products_main(repeats: int) -> None:
    from ..provenance import describe
    from .run_stats import machine

    tflops = product_throughput(repeats)
    for name, rows in tflops.items():
        print(f"{name:22s} " + "  ".join(f"{shape} {v:6.3f}" for shape, v in rows.items()) + "  TFLOP/s")
    print(json.dumps({"tflops": tflops, "repeats": repeats, "threads": torch.get_num_threads(),
                      "machine": machine(["--cpu"]), "provenance": describe()}))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--products", action="store_true",
                    help="time the matrix products alone, TFLOP/s per kernel choice")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=40)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--slow-steps", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fairseq", action="store_true",
                    help="time fairseq's encoder-decoder transformer (as the plugin runs it)")
    ap.add_argument("--fconv", action="store_true",
                    help="time fairseq's convolutional encoder-decoder (fconv: --layers ConvTBC layers "
                    "of width --dim each side)")
    ap.add_argument("--lstm", action="store_true",
                    help="time fairseq's LSTM encoder-decoder (--layers LSTM layers of --dim each side)")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    if a.products:
        return products_main(max(a.steps, 1))
    arch = next((k for k in BUILDERS if getattr(a, k)), None)
    if arch:  # fairseq models: (source, target) token ids
        tokens = tuple(torch.randint(4, 8000, (a.batch, a.seq)) for _ in range(2))
        make = lambda: BUILDERS[arch](a.layers, a.dim)  # noqa: E731
        batch_for = lambda dtype: tokens  # noqa: E731
        model_name = {"fconv": f"fairseq fconv {a.layers}+{a.layers} ConvTBC layers (kernel 3) d={a.dim}",
                      "lstm": f"fairseq lstm {a.layers}+{a.layers} layers d={a.dim}",
                      "fairseq": f"fairseq transformer {a.layers}+{a.layers} layers d={a.dim} ffn={2 * a.dim}"}[arch]
        model_name += f", vocab 8000, batch {a.batch}x{a.seq} tokens per side"
    else:
        x32 = torch.randn(a.batch, a.seq, a.dim)
        make = lambda: build(a.layers, a.dim)  # noqa: E731
        batch_for = lambda dtype: x32.to(dtype)  # noqa: E731
        model_name = f"TransformerEncoder {a.layers}x d={a.dim} ffn={4 * a.dim}, batch {a.batch}x{a.seq}"
    variants = [("fp32", torch.float32, False), ("fp16 native", torch.float16, False),
                ("fp16 fp32-accumulate", torch.float16, True),
                ("fp16 fp32-accumulate dispatch", torch.float16, "dispatch"),
                ("bf16 native", torch.bfloat16, False), ("bf16 fp32-accumulate", torch.bfloat16, True),
                ("bf16 fp32-accumulate dispatch", torch.bfloat16, "dispatch")]
    models, times = {}, {name: [] for name, _, _ in variants}
    for name, dtype, _ in variants:
        models[name] = make()
        apply_fp32_islands(models[name])
        models[name].to(dtype)
        if dtype != torch.float32:  # translation_fp16's half models: fairseq's attention path
            for module in models[name].modules():
                if hasattr(module, "_set_skip_embed_dim_check"):
                    module._set_skip_embed_dim_check()
    for _ in range(a.rounds):
        for name, dtype, acc in variants:
            slow = dtype != torch.float32 and not acc and not cpu_has_native_half(dtype)
            times[name] += time_steps(models[name], batch_for(dtype), a.slow_steps if slow else a.steps, acc)
    results = {name: statistics.median(t) for name, t in times.items()}
    for name, _, _ in variants:
        lo, hi = min(times[name]), max(times[name])
        print(f"{name:30s} {results[name]:9.1f} ms/step (min {lo:.1f}, max {hi:.1f})  "
              f"x{results[name] / results['fp32']:.2f} of fp32", flush=True)
    with Fp32AccumulateMatmul() as mode:  # how many products one step routes
        loss_of(models["fp16 fp32-accumulate"], batch_for(torch.float16)).backward()
    summary = {
        "model": model_name,
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpu_native_fp16": cpu_has_native_half(torch.float16), "cpu_native_bf16": cpu_has_native_half(torch.bfloat16),
        "products_per_step": mode.calls,
        "rounds": a.rounds, "steps_per_round": a.steps, "statistic": "median",
        "ms_per_step": {k: round(v, 1) for k, v in results.items()},
        "ratio_to_fp32": {k: round(v / results["fp32"], 3) for k, v in results.items()},
    }
    print(json.dumps(summary))

