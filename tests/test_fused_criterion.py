"""--fused-loss: fairseq's two criteria with the fused loss, on small fairseq models and in fairseq-train."""

import logging
from argparse import Namespace

import pytest
import torch
from fairseq.criterions.cross_entropy import CrossEntropyCriterion
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion
from fairseq.data import Dictionary
from fairseq.distributed import ModuleProxyWrapper
from fairseq.models import FairseqDecoder, FairseqEncoder, FairseqEncoderDecoderModel

from conftest import train
from fairseq_fp16 import fused_criterion
from fairseq_fp16.fused_criterion import (
    FusedCrossEntropyCriterion,
    FusedLabelSmoothedCrossEntropyCriterion,
    plain_log_softmax,
)

VOCAB, DIM = 300, 16


class Encoder(FairseqEncoder):
    def forward(self, src_tokens, src_lengths=None):
        return None


class Decoder(FairseqDecoder):
    def __init__(self, dictionary):
        super().__init__(dictionary)
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.proj = torch.nn.Linear(DIM, VOCAB)

    def forward(self, prev_output_tokens, encoder_out=None):
        return self.proj(self.embed(prev_output_tokens)), {}


class Model(FairseqEncoderDecoderModel):
    pass


class TemperatureModel(Model):
    """A model with its own normalisation: the fused loss must not be used for it."""

    def get_normalized_probs(self, net_output, log_probs, sample=None):
        return torch.log_softmax(net_output[0].float() / 2, dim=-1)


def dictionary():
    d = Dictionary()
    for i in range(VOCAB - len(d)):
        d.add_symbol(f"w{i}")
    return d


def model_and_sample(cls=Model, dtype=torch.float16):
    torch.manual_seed(0)
    d = dictionary()
    model = cls(Encoder(d), Decoder(d)).to(dtype)
    tokens = torch.randint(4, VOCAB, (6, 9))
    target = torch.randint(4, VOCAB, (6, 9))
    target[0, -3:] = d.pad()
    sample = {"net_input": {"src_tokens": tokens, "src_lengths": None, "prev_output_tokens": tokens},
              "target": target, "ntokens": int(target.ne(d.pad()).sum())}
    return model, sample, Namespace(target_dictionary=d, source_dictionary=d)


def run(criterion, model, sample):
    model.zero_grad()
    loss, _, log = criterion(model, sample)
    loss.backward()
    return loss.detach(), log.get("nll_loss", log["loss"]), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("stock_cls,fused_cls,kw", [
    (LabelSmoothedCrossEntropyCriterion, FusedLabelSmoothedCrossEntropyCriterion,
     dict(label_smoothing=0.1, ignore_prefix_size=2)),
    (CrossEntropyCriterion, FusedCrossEntropyCriterion, {}),
])
def test_fused_criterion_gives_fairseqs_loss_and_gradients(stock_cls, fused_cls, kw):
    model, sample, task = model_and_sample()
    ref = run(stock_cls(task, sentence_avg=False, **kw), model, sample)
    got = run(fused_cls(task, sentence_avg=False, **kw), model, sample)
    torch.testing.assert_close(got[0], ref[0], rtol=2e-6, atol=0)
    torch.testing.assert_close(got[1], ref[1], rtol=2e-6, atol=0)
    # the name a checkpoint records: resuming across --fused-loss settings is not refused
    assert fused_cls.__name__ == stock_cls.__name__
    if stock_cls is CrossEntropyCriterion:  # (loss, loss), as fairseq's
        fused = fused_cls(task, sentence_avg=False)
        loss, nll = fused.compute_loss(model, model(**sample["net_input"]), sample)
        assert torch.equal(loss, nll) and torch.equal(loss, got[0])
    for g, r in zip(got[2], ref[2]):  # half gradients, fp32 math in a different order
        torch.testing.assert_close(g.float(), r.float(), rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_report_accuracy_counts_fairseqs_correct_tokens_without_log_probabilities(dtype, monkeypatch):
    model, sample, task = model_and_sample(dtype=dtype)
    kw = dict(sentence_avg=False, label_smoothing=0.1, ignore_prefix_size=1, report_accuracy=True)
    net_output = model(**sample["net_input"])
    target = sample["target"][:, 1:]
    # make some predictions right: the argmax of a few rows is their target
    with torch.no_grad():
        rows = torch.arange(0, 6)
        net_output[0][rows, 3, target[rows, 2]] = net_output[0][rows, 3].max() + 1
    ref = LabelSmoothedCrossEntropyCriterion(task, **kw).compute_accuracy(model, net_output, sample)
    monkeypatch.setattr(type(model), "get_normalized_probs",
                        lambda *a, **k: pytest.fail("fp32 log-probabilities were computed"))
    monkeypatch.setattr(fused_criterion, "plain_log_softmax", lambda m: True)
    got = FusedLabelSmoothedCrossEntropyCriterion(task, **kw).compute_accuracy(model, net_output, sample)
    assert ref[1] == got[1] == int(target.ne(task.target_dictionary.pad()).sum()) == 45
    assert ref[0] == got[0] and 6 <= int(got[0]) < 45
    # a model with its own normalisation is counted by fairseq's method
    monkeypatch.setattr(fused_criterion, "plain_log_softmax", lambda m: False)
    with pytest.raises(pytest.fail.Exception, match="fp32 log-probabilities were computed"):
        FusedLabelSmoothedCrossEntropyCriterion(task, **kw).compute_accuracy(model, net_output, sample)


def test_own_normalisation_and_per_token_losses_use_fairseqs_loss(caplog, monkeypatch):
    monkeypatch.setattr(fused_criterion._FusedLoss, "_warned", False)
    model, sample, task = model_and_sample(TemperatureModel)
    kw = dict(sentence_avg=False, label_smoothing=0.1)
    fused = FusedLabelSmoothedCrossEntropyCriterion(task, **kw)
    with caplog.at_level(logging.WARNING):
        got = run(fused, model, sample)
    ref = run(LabelSmoothedCrossEntropyCriterion(task, **kw), model, sample)
    assert torch.equal(got[0], ref[0])  # the model's temperature is applied: its own path
    assert "TemperatureModel does not normalise with fairseq's plain log-softmax" in caplog.text
    model, sample, task = model_and_sample()
    net_output = model(**sample["net_input"])
    per_token = fused.compute_loss(model, net_output, sample, reduce=False)[0]
    assert per_token.shape == (6 * 9, 1)


def test_plain_log_softmax_is_recognised_through_wrappers():
    model, _, _ = model_and_sample()
    assert plain_log_softmax(model)
    wrapped = torch.nn.Module()
    wrapped.module = model  # as DistributedDataParallel holds it
    assert plain_log_softmax(ModuleProxyWrapper(wrapped))
    assert not plain_log_softmax(model_and_sample(TemperatureModel)[0])
    model.decoder.adaptive_softmax = torch.nn.Identity()
    assert not plain_log_softmax(model)


@pytest.mark.slow
def test_fairseq_train_with_the_fused_loss_logs_fairseqs_losses(toy_data, tmp_path):
    flags = ["--half-matmul", "fp32-accumulate", "--max-update", "20"]
    proc, fused = train(toy_data, tmp_path / "fused", "--fp16", *flags)
    assert ("--fused-loss auto: label_smoothed_cross_entropy computes its loss from the logits in fp32 "
            "chunks" in proc.stderr + proc.stdout)
    _, stock = train(toy_data, tmp_path / "stock", "--fp16", *flags, "--fused-loss", "off")
    proc, stream = train(toy_data, tmp_path / "stream", "--fp16", *flags, "--fused-loss", "stream")
    assert "--fused-loss stream: label_smoothed_cross_entropy computes" in proc.stderr + proc.stdout
    proc, compiled = train(toy_data, tmp_path / "compiled", "--fp16", *flags, "--fused-loss", "compiled")
    assert "in fp32 chunks (the compiled path)" in proc.stderr + proc.stdout
    assert len(fused) == len(stock) == len(stream) == len(compiled) == 20
    # the CPU's cache path, CUDA's stream path and the compiled one against fairseq's loss
    for b, *ours in zip(stock, fused, stream, compiled):
        for a in ours:
            assert abs(a["loss"] - b["loss"]) <= 0.002 and abs(a["nll_loss"] - b["nll_loss"]) <= 0.002, (a, b)
    proc, _ = train(toy_data, tmp_path / "fp32", *flags)  # auto: fp32 keeps fairseq's loss
    assert "--fused-loss" not in proc.stderr + proc.stdout
