"""fairseq-train on the CPU: the dropout masks --cpu-dropout chooses (reproducible under fairseq's
seeding and across a resume), and --amp as torch's bf16 autocast. Runs in the test process
(tests/inprocess.py)."""

import math

import pytest
import torch
from fairseq.modules.fairseq_dropout import FairseqDropout

from conftest import TINY_MODEL, TRAIN, USER_DIR
from inprocess import fairseq_train

from fairseq_fp16.core.dropout import AUTO_MIN_NUMEL
from fairseq_fp16.features import COUNTER_MASKS

UPDATES, CUT = 8, 4
#: a model whose activations (about 1,000 tokens x 256) take counter-based masks under auto
WIDE = ["--encoder-embed-dim", "256", "--decoder-embed-dim", "256",
        "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512"]


def train(data, save_dir, *flags, updates=UPDATES, model=TINY_MODEL, inspect=None):
    """The per-update losses (bits per token) of a run; ``inspect(trainer)`` runs once it is built."""
    log = []

    def on_load(trainer, extra_state):
        if inspect is not None:
            inspect(trainer)
        step = trainer.task.train_step

        def train_step(sample, model, criterion, optimizer, *args, **kwargs):
            loss, sample_size, out = step(sample, model, criterion, optimizer, *args, **kwargs)
            log.append(float(loss.detach()) / sample_size / math.log(2))
            return loss, sample_size, out

        trainer.task.train_step = train_step

    fairseq_train([data, *model, *TRAIN, "--user-dir", USER_DIR, "--save-dir", save_dir,
                   "--max-update", updates, *flags], on_load=on_load)
    return log


def masks_of(trainer):
    return {getattr(m, COUNTER_MASKS, "unset") for m in trainer.model.modules() if isinstance(m, FairseqDropout)}


@pytest.mark.parametrize("flags", [["--bf16"], []], ids=["bf16", "fp32"])
def test_counter_masks_repeat_under_fairseqs_seed_and_across_a_resume(toy_data, tmp_path, flags):
    seen = []
    full = train(toy_data, tmp_path / "full", "--cpu-dropout", "counter", *flags,
                 inspect=lambda t: seen.append(masks_of(t)))
    assert seen == [{0}]  # every dropout module, every tensor
    assert train(toy_data, tmp_path / "again", "--cpu-dropout", "counter", *flags) == full
    cut = tmp_path / "cut"
    first = train(toy_data, cut, "--cpu-dropout", "counter", *flags, updates=CUT)
    rest = train(toy_data, cut, "--cpu-dropout", "counter", *flags)
    assert first + rest == full  # exactly: the resumed updates drew the same masks
    # torch's masks: other draws, the same expectation
    bernoulli = train(toy_data, tmp_path / "torch", "--cpu-dropout", "torch", *flags,
                      inspect=lambda t: seen.append(masks_of(t)))
    assert seen[-1] == {None}
    assert bernoulli != full and max(abs(a - b) for a, b in zip(bernoulli, full)) < 0.3
    assert full[-1] < full[0] - 0.3  # it learns (7.22 -> 6.73 bits in bf16)


def test_auto_takes_counter_masks_for_large_tensors_only(toy_data, tmp_path, monkeypatch):
    from fairseq_fp16.patches import dropout as patch

    sizes = []

    def counting(x, p):
        sizes.append(x.numel())
        return counter(x, p)

    counter = patch.counter_dropout
    monkeypatch.setattr(patch, "counter_dropout", counting)
    seen = []
    train(toy_data, tmp_path / "tiny", "--bf16", "--no-save", updates=2,
          inspect=lambda t: seen.append(masks_of(t)))
    assert seen == [{AUTO_MIN_NUMEL}] and sizes == []  # 1,000 tokens x 32: torch's masks
    train(toy_data, tmp_path / "wide", "--bf16", "--no-save", updates=2, model=[*TINY_MODEL, *WIDE])
    assert sizes and min(sizes) >= AUTO_MIN_NUMEL


def test_counter_masks_are_refused_where_they_cannot_be_compiled(toy_data, tmp_path, monkeypatch):
    import fairseq_fp16.features as features

    monkeypatch.setattr(features, "counter_dropout_available", lambda dtype: False)
    with pytest.raises(ValueError, match="--cpu-dropout counter: torch.compile cannot build the "
                                         "counter-based mask on this machine"):
        train(toy_data, tmp_path, "--cpu-dropout", "counter", "--no-save", updates=1)


def test_amp_on_the_cpu_trains_under_bf16_autocast_with_fp32_weights(toy_data, tmp_path):
    products, weights = [], []

    def watch(trainer):
        weights.append({p.dtype for p in trainer.model.parameters()})
        linear = next(m for n, m in trainer.model.named_modules() if n.endswith("fc1"))
        def record(module, inputs, out):  # the training steps' products (validation runs in fp32)
            if module.training:
                products.append(out.dtype)

        linear.register_forward_hook(record)

    fp32 = train(toy_data, tmp_path / "fp32", "--no-save")
    amp = train(toy_data, tmp_path / "amp", "--amp", "--no-save", inspect=watch)
    assert weights == [{torch.float32}] and set(products) == {torch.bfloat16}
    assert amp != fp32 and max(abs(a - b) for a, b in zip(amp, fp32)) < 0.05


def test_amp_with_a_half_precision_is_refused(toy_data, tmp_path):
    for half in ("--bf16", "--fp16"):
        with pytest.raises(ValueError, match=f"--amp and {half} are exclusive: --amp keeps fp32 "
                                             "weights and runs the forward under torch.autocast"):
            train(toy_data, tmp_path, "--amp", half, "--no-save", updates=1)
