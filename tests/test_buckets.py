"""--length-buckets: batches of a few fixed shapes, and padding sentences that change nothing.

The core's fitting and batching are checked on synthetic lengths; the task's batches on the toy
corpus, through fairseq's own batch iterator and collater; a padding sentence against the same
batch without it, loss and gradients of a real model and criterion.
"""

import numpy as np
import pytest
import torch

from conftest import TINY_MODEL, TRAIN, USER_DIR
from fairseq_fp16.core.buckets import (
    AUTO_MAX_SHAPES,
    LengthBuckets,
    assign_buckets,
    fit_length_buckets,
    parse_length_buckets,
)


def wmt_like_lengths(n=20000, seed=0):
    """Source lengths of a long-tailed mix and targets 0.8-1.6 times as long (a real corpus's
    spread), plus the end-of-sentence token."""
    rng = np.random.RandomState(seed)
    src = np.clip(rng.lognormal(3.0, 0.5, n), 1, 120).astype(np.int64) + 1
    tgt = np.clip(src * rng.uniform(0.8, 1.6, n), 1, 200).astype(np.int64) + 1
    return src, tgt


# ------------------------------------------------------------------------------ the core
@pytest.mark.parametrize("choice", ["1", "4", "16", "auto"])
def test_every_sentence_is_held_by_its_bucket_within_the_token_budget(choice):
    src, tgt = wmt_like_lengths()
    buckets = fit_length_buckets(src, tgt, choice, max_tokens=4096, batch_multiple=8)
    most = AUTO_MAX_SHAPES if choice == "auto" else int(choice)
    assert 1 <= len(buckets) <= most
    owner = buckets.assign(src, tgt)
    bounds = buckets.bounds[owner]
    assert (src <= bounds[:, 0]).all() and (tgt <= bounds[:, 1]).all()
    for shape in buckets.shapes:
        assert shape.sentences * max(shape.source, shape.target) <= 4096  # fairseq's budget
        assert shape.sentences % 8 == 0
    indices = np.random.RandomState(1).permutation(len(src))
    batches = buckets.batches(indices, owner[indices])
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(src)))  # each sentence once
    for batch in batches:
        (k,) = set(owner[batch].tolist())  # one bucket's sentences
        assert len(batch) <= buckets.shapes[k].sentences
    stats = buckets.stats(src, tgt)
    # the even spread: each batch's free places are fewer than the batch-size multiple
    assert stats["padding_sentences"] < 8 * stats["batches"]
    assert stats["batches"] == len(batches) and stats["shapes"] == len(buckets)


def test_more_buckets_pad_less_and_two_dimensions_beat_one_length_for_both():
    src, tgt = wmt_like_lengths()
    padding = {n: fit_length_buckets(src, tgt, n, max_tokens=4096).stats(src, tgt)["padding"]
               for n in (1, 4, 16)}
    assert padding[1] > padding[4] > padding[16]
    # 16 buckets of one length for both sides, at the quantiles of the longer side (fairseq's
    # --num-batch-buckets pads each side to its own quantile and cuts batches by the longer)
    longer = np.maximum(src, tgt)
    edges = np.unique(np.percentile(longer, np.linspace(0, 100, 17)[1:], method="lower").astype(np.int64))
    one = LengthBuckets(np.stack([edges, edges], 1), max_tokens=4096)
    assert padding[16] < 0.75 * one.stats(src, tgt)["padding"]  # measured: 15.2% against 30.4%
    auto = fit_length_buckets(src, tgt, "auto", max_tokens=4096, batch_multiple=8)
    assert len(auto) <= AUTO_MAX_SHAPES


def test_lengths_that_come_in_few_pairs_get_exact_boxes():
    src = np.repeat([5, 9, 9, 14, 20], 100)
    tgt = np.repeat([6, 8, 12, 14, 25], 100)
    buckets = fit_length_buckets(src, tgt, 5, max_tokens=1000)
    assert sorted(map(tuple, buckets.bounds.tolist())) == sorted(set(zip(src.tolist(), tgt.tolist())))
    owner = buckets.assign(src, tgt)
    assert (buckets.bounds[owner] == np.stack([src, tgt], 1)).all()  # no sentence is padded
    rounded = fit_length_buckets(src, tgt, 5, max_tokens=1000, length_multiple=8)
    assert (rounded.bounds % 8 == 0).all()  # --required-seq-len-multiple / --cpu-length-multiple


def test_a_bucket_spreads_its_sentences_evenly_over_its_batches():
    # 1,000 sentences, at most 448 a batch: 3 batches either way, of 336 (8 padding sentences)
    # instead of 448, 448 and 104 (344)
    src = tgt = np.full(1000, 9)
    even = fit_length_buckets(src, tgt, 1, max_tokens=4096, batch_multiple=8)
    assert [s.sentences for s in even.shapes] == [336]
    assert even.stats(src, tgt)["padding_sentences"] == 8
    most = LengthBuckets(even.bounds, max_tokens=4096, batch_multiple=8)
    assert [s.sentences for s in most.shapes] == [448]
    assert most.stats(src, tgt)["padding_sentences"] == 344


def test_a_sentence_no_bucket_holds_or_no_token_budget_is_refused():
    with pytest.raises(ValueError, match=r"--length-buckets: a sentence of 30 source and 4 target tokens "
                                         r"fits no bucket"):
        assign_buckets([[20, 20]], [30], [4])
    with pytest.raises(ValueError, match=r"--max-tokens 16 holds no sentence of 20 tokens"):
        LengthBuckets([[20, 12]], max_tokens=16)
    with pytest.raises(ValueError, match=r"--length-buckets needs --max-tokens"):
        LengthBuckets([[20, 12]])


@pytest.mark.parametrize("value", ["0", "-3", "many", "", "1.5"])
def test_bad_values_are_refused_naming_the_flag(value):
    with pytest.raises(ValueError, match=r"--length-buckets must be off, auto or an integer >= 1 \(the "
                                         rf"most batch shapes\), got '{value}'"):
        parse_length_buckets(value)
    assert parse_length_buckets("off") is None and parse_length_buckets("auto") == "auto"
    assert parse_length_buckets("12") == 12


# ------------------------------------------------------------------------------ the task
def build_task(data, *flags):
    """translation_fp16 set up as fairseq-train sets it up (flags parsed, validated), with its
    train and valid splits loaded."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [str(data), *TINY_MODEL, *TRAIN, "--user-dir", USER_DIR,
                                                "--save-dir", "unused", *flags])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    for split in ("train", "valid"):
        task.load_dataset(split)
    return task, cfg


def epoch_batches(task, split, max_tokens=1000):
    itr = task.get_batch_iterator(task.dataset(split), max_tokens=max_tokens, max_positions=(1024, 1024),
                                  required_batch_size_multiple=8, seed=1)
    return list(itr.next_epoch_itr(shuffle=True))


REFUSED = [
    (["--length-buckets", "0"], r"--length-buckets must be off, auto or an integer >= 1 \(the most batch "
                                r"shapes\), got '0'"),
    (["--length-buckets", "few"], r"--length-buckets must be off, auto or an integer >= 1 .*got 'few'"),
    (["--length-buckets", "auto", "--num-batch-buckets", "4"],
     r"--length-buckets and fairseq's --num-batch-buckets both pad lengths to buckets; pass one of them"),
    (["--cuda-graphs", "--length-buckets", "auto"],
     r"--cuda-graphs runs the compiled layers as CUDA graphs; add --compile-layers"),
    (["--cuda-graphs", "--compile-layers"],
     r"--cuda-graphs needs --length-buckets N or auto: a graph is recorded for each batch shape"),
]


@pytest.mark.parametrize("flags,message", REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_the_task_refuses_bad_flags_naming_them(toy_data, flags, message):
    with pytest.raises(ValueError, match=message):
        build_task(toy_data, *flags)


def test_every_batch_of_a_bucket_has_its_shape_and_every_sentence_comes_once(toy_data):
    task, _ = build_task(toy_data, "--length-buckets", "4")
    pad = task.source_dictionary.pad()
    batches = epoch_batches(task, "train")
    buckets = vars(task.dataset("train"))["_fairseq_fp16_length_buckets"].buckets
    shapes = {(s.sentences, s.source, s.target) for s in buckets.shapes}
    assert len(shapes) <= 4
    seen, filled = [], 0
    for b in batches:
        src, tgt, prev = b["net_input"]["src_tokens"], b["target"], b["net_input"]["prev_output_tokens"]
        assert (src.size(0), src.size(1), tgt.size(1)) in shapes and tgt.shape == prev.shape
        real = tgt.ne(pad).any(1)  # a padding sentence's target is padding alone
        assert b["nsentences"] == int(real.sum()) and b["ntokens"] == int(tgt.ne(pad).sum())
        # a padding sentence: one end-of-sentence token to attend to, a decoder input of it alone
        assert (src[~real].ne(pad).sum(1) == 1).all() and (prev[~real].ne(pad).sum(1) == 1).all()
        assert (b["id"][~real] == -1).all()
        seen += b["id"][real].tolist()
        filled += int((~real).sum())
    assert sorted(seen) == list(range(len(task.dataset("train"))))
    assert 0 < filled < 8 * len(batches)
    # validation keeps fairseq's batches: lengths as they come
    valid = epoch_batches(task, "valid")
    assert all(b["nsentences"] == b["target"].size(0) for b in valid)
    assert len({(b["net_input"]["src_tokens"].shape, b["target"].shape) for b in valid}) == len(valid)


def _loss_and_grads(task, model, criterion, sample):
    model.zero_grad()
    loss, sample_size, _ = criterion(model, sample)
    loss.backward()
    return loss.detach(), sample_size, {n: p.grad.clone() for n, p in model.named_parameters()
                                        if p.grad is not None}


def _without_rows(sample, keep):
    net = sample["net_input"]
    return dict(sample, id=sample["id"][keep], target=sample["target"][keep],
                net_input=dict(net, src_tokens=net["src_tokens"][keep], src_lengths=net["src_lengths"][keep],
                               prev_output_tokens=net["prev_output_tokens"][keep]))


@pytest.mark.parametrize("loss", ["off", "on"], ids=["fairseq-loss", "fused-loss"])
def test_padding_sentences_add_nothing_to_the_loss_or_the_gradients(toy_data, loss):
    task, cfg = build_task(toy_data, "--length-buckets", "4", "--dropout", "0", "--fused-loss", loss)
    torch.manual_seed(1)
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    from fairseq_fp16.fused_criterion import FusedLabelSmoothedCrossEntropyCriterion

    assert isinstance(criterion, FusedLabelSmoothedCrossEntropyCriterion) == (loss == "on")
    model.train()
    pad = task.source_dictionary.pad()
    batch = next(b for b in epoch_batches(task, "train") if not b["target"].ne(pad).any(1).all())
    real = batch["target"].ne(pad).any(1)
    with_padding = _loss_and_grads(task, model, criterion, batch)
    without = _loss_and_grads(task, model, criterion, _without_rows(batch, real))
    assert with_padding[1] == without[1]  # sample size: the target tokens
    torch.testing.assert_close(with_padding[0], without[0], rtol=1e-6, atol=0)
    assert with_padding[2].keys() == without[2].keys()
    for name, grad in with_padding[2].items():
        # the same up to the order of fp32 additions (a matrix product of more rows is blocked
        # differently): measured 5e-7 of each tensor's largest element, 3e-7 in a key bias whose
        # gradient is zero but for rounding
        ref = without[2][name]
        torch.testing.assert_close(grad, ref, rtol=0, atol=1e-5 * float(ref.abs().max()) + 1e-6, msg=name)


def test_bucket_stats_counts_the_shapes_of_fairseqs_batches_and_of_the_buckets(toy_data, capsys):
    import json

    from fairseq_fp16_tools.bucket_stats import main, training_lengths

    assert main([str(toy_data), "--max-tokens", "1000,4000", "--length-buckets", "4", "--name", "toy"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["sentences"] == 2000 and record["provenance"]["torch"] == torch.__version__
    for r in record["results"]:
        fairseq, bucketed = r["fairseq"], r["bucketed"]
        assert bucketed["shapes"] == len(bucketed["buckets"]) <= 4 < fairseq["shapes"]
        # the toy's targets have their sources' length: fairseq's batches, of one length, pad little
        assert 0 <= fairseq["padding"] < bucketed["padding"] < 0.5
    # with fairseq's --required-batch-size-multiple 8, as the task batches (the test above)
    src, tgt, _ = training_lengths(toy_data)
    expect = fit_length_buckets(src, tgt, 4, max_tokens=1000, batch_multiple=8).stats(src, tgt)
    assert {k: record["results"][0]["bucketed"][k] for k in expect} == expect
