"""The tasks fairseq users fine-tune with, trained with the plugin in fp32, fp16 and bf16 on the CPU:
``translation_multi_simple_epoch`` over two language pairs, and a ``bart_base``-architecture model
trained a few updates as BART is (``--task denoising``), saved, then fine-tuned for translation
from that checkpoint as BART's recipes do (``--restore-file ... --reset-optimizer
--reset-dataloader --reset-meters``). Each half run tracks fp32's losses, a run stopped and resumed
trains as the uninterrupted one, and fairseq-generate decodes with the task's flags in --fp16 and
--bf16. The runs are in this process (tests/inprocess.py), on the toy corpus's validation split
(several epochs in a few updates: the multilingual task samples its pairs anew every epoch)."""

import math

import pytest

from conftest import USER_DIR
from inprocess import fairseq_generate, fairseq_train

pytestmark = pytest.mark.slow

PRECISIONS = {"fp32": [], "fp16": ["--fp16"], "bf16": ["--bf16"]}
SMALL = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32",
         "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
         "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]
COMMON = ["--optimizer", "fp16_adam", "--adam-betas", "(0.9, 0.98)", "--lr", "3e-3",
          "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "20", "--max-tokens", "1000", "--cpu",
          "--seed", "1", "--num-workers", "0", "--no-epoch-checkpoints", "--disable-validation",
          "--user-dir", USER_DIR, "--half-matmul", "fp32-accumulate"]
TRANSLATION_LOSS = ["--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1"]
#: the multilingual task as its users run it: language tokens on both sides, pairs sampled
#: with a temperature
MULTI_TASK = ["--task", "translation_multi_simple_epoch", "--lang-pairs", "src-tgt,tgt-src",
              "--encoder-langtok", "src", "--decoder-langtok"]
MULTI = [*MULTI_TASK, "--sampling-method", "temperature", "--sampling-temperature", "1.5"]
MULTI_MODEL = ["--arch", "transformer", *SMALL, "--share-all-embeddings", "--dropout", "0.1"]
BART_MODEL = ["--arch", "bart_base", *SMALL, "--dropout", "0.1", "--attention-dropout", "0.1"]
#: BART's pretraining objective: spans masked (Poisson lengths, one <mask> each), whole sentences
#: packed into blocks
DENOISING = ["--task", "denoising", "--criterion", "cross_entropy", "--mask", "0.3", "--mask-random", "0.1",
             "--mask-length", "span-poisson", "--poisson-lambda", "3.5", "--replace-length", "1",
             "--rotate", "0", "--tokens-per-sample", "64", "--sample-break-mode", "complete"]
FINETUNE = ["--task", "translation", *TRANSLATION_LOSS]
RESTORE = ["--reset-optimizer", "--reset-dataloader", "--reset-meters"]
UPDATES, CUT, PRETRAIN = 12, 6, 4


def _recorder(log: list):
    """An ``on_load`` hook (tests/inprocess.py) that appends, for each update, its loss per token
    in bits (as fairseq logs it, unrounded) and the loss scale the update ran with."""

    def on_load(trainer, extra_state):
        task = trainer.task
        step = task.train_step

        def train_step(sample, model, criterion, optimizer, *args, **kwargs):
            scaler = getattr(optimizer, "scaler", None)
            scale = float(scaler.loss_scale) if scaler is not None else None
            loss, sample_size, logging_output = step(sample, model, criterion, optimizer, *args, **kwargs)
            log.append((float(loss.detach()) / sample_size / math.log(2), scale))
            return loss, sample_size, logging_output

        task.train_step = train_step

    return on_load


def train(args, updates):
    log = []
    fairseq_train([*args, "--max-update", updates], on_load=_recorder(log))
    return log


def losses(log):
    return [loss for loss, _ in log]


def _tracks_fp32(runs, tol):
    ref = losses(runs["fp32"])
    for name in ("fp16", "bf16"):
        half = losses(runs[name])
        assert len(half) == len(ref)
        assert max(abs(a - b) for a, b in zip(ref, half)) < tol, (name, ref, half)


def hypotheses(text):
    """{sentence id: (score, hypothesis)} of fairseq-generate's H- lines."""
    out = {}
    for line in text.splitlines():
        if line.startswith("H-"):
            key, score, hyp = line.split("\t")
            out[int(key[2:])] = (float(score), hyp)
    return out


# --------------------------------------------------------------- translation_multi_simple_epoch
@pytest.fixture(scope="module")
def multi(toy_data, tmp_path_factory):
    """Each precision's run of UPDATES updates, and the fp16 and bf16 runs stopped at CUT and resumed."""
    root = tmp_path_factory.mktemp("multi")
    common = [toy_data, *MULTI, *MULTI_MODEL, *COMMON, *TRANSLATION_LOSS, "--train-subset", "valid"]
    runs, resumed = {}, {}
    for name, flags in PRECISIONS.items():
        runs[name] = train([*common, *flags, "--save-dir", root / name], UPDATES)
    for name in ("fp16", "bf16"):
        cut = [*common, *PRECISIONS[name], "--save-dir", root / f"{name}-cut"]
        resumed[name] = (train(cut, CUT), train(cut, UPDATES))
    return root, common, runs, resumed


def test_multilingual_half_runs_track_fp32(multi):
    _, _, runs, _ = multi
    _tracks_fp32(runs, 0.05)
    assert losses(runs["fp32"])[-1] < losses(runs["fp32"])[0] - 0.5  # it learns (7.49 -> 6.84)
    assert runs["fp16"][0][1] == 128.0  # fp16 scales its loss (fairseq's initial scale)
    assert all(scale is None or scale == 1.0 for _, scale in runs["bf16"])


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_multilingual_resumed_run_trains_as_the_uninterrupted_one(multi, name):
    _, _, runs, resumed = multi
    first, rest = resumed[name]
    assert len(first) == CUT and len(rest) == UPDATES - CUT
    assert first + rest == runs[name]  # losses and loss scales, exactly


def _generate(data, checkpoint, task_flags, precision):
    return hypotheses(fairseq_generate([
        data, "--path", checkpoint, *task_flags, *PRECISIONS[precision], "--cpu", "--user-dir", USER_DIR,
        "--half-matmul", "fp32-accumulate", "--gen-subset", "valid", "--beam", "2", "--max-len-b", "10",
        "--batch-size", "50", "--required-batch-size-multiple", "1"]))


# hypotheses of 100 a half decoding must share with fp32's: bf16 rounds at 2**-8, 8x fp16's
# 2**-11, and a toy model's beams hold near-ties (the multilingual checkpoint: fp16 96, bf16 89)
AGREE = {"fp16": 90, "bf16": 85}


def _decodes_as_fp32(data, checkpoint, task_flags):
    """The checkpoint decoded in fp32, fp16 and bf16: a hypothesis for every sentence, the half
    decodings' scores near fp32's."""
    ref = _generate(data, checkpoint, task_flags, "fp32")
    assert len(ref) == 100
    for name in ("fp16", "bf16"):
        half = _generate(data, checkpoint, task_flags, name)
        assert sorted(half) == sorted(ref)
        same = [k for k in ref if half[k][1] == ref[k][1]]
        assert len(same) >= AGREE[name], name
        assert max(abs(half[k][0] - ref[k][0]) for k in same) < 0.02, name


def test_multilingual_checkpoint_decodes_in_half_precision(multi, toy_data):
    root, _, _, _ = multi
    _decodes_as_fp32(toy_data, root / "fp16" / "checkpoint_last.pt",
                     [*MULTI_TASK, "--source-lang", "src", "--target-lang", "tgt"])


# ------------------------------------------------------------------------------- bart_base
@pytest.fixture(scope="module")
def bart(toy_data, tmp_path_factory):
    """BART as its users train it, per precision: PRETRAIN denoising updates on the source side,
    then UPDATES of translation fine-tuning from that checkpoint (BART's recipe: --restore-file
    with the resets); and the fp16 and bf16 fine-tunes run as --finetune-from-model, stopped at
    CUT and resumed."""
    root = tmp_path_factory.mktemp("bart")
    mono = root / "mono"  # the source side as a monolingual corpus (fairseq's file names)
    mono.mkdir()
    (mono / "dict.txt").symlink_to(toy_data / "dict.src.txt")
    for split in ("train", "valid"):
        for ext in ("bin", "idx"):
            (mono / f"{split}.{ext}").symlink_to(toy_data / f"{split}.src-tgt.src.{ext}")
    pretrain, finetune, resumed = {}, {}, {}
    for name, flags in PRECISIONS.items():
        pre = root / f"{name}-pretrain"
        pretrain[name] = train([mono, *DENOISING, *BART_MODEL, *COMMON, *flags, "--save-dir", pre,
                                "--train-subset", "valid"], PRETRAIN)
        tune = [toy_data, *FINETUNE, *BART_MODEL, *COMMON, *flags, "--train-subset", "valid"]
        finetune[name] = train([*tune, "--save-dir", root / name, "--restore-file",
                                pre / "checkpoint_last.pt", *RESTORE], UPDATES)
        if name != "fp32":
            cut = [*tune, "--save-dir", root / f"{name}-cut", "--finetune-from-model",
                   pre / "checkpoint_last.pt"]
            resumed[name] = (train(cut, CUT), train(cut, UPDATES))
    return root, pretrain, finetune, resumed


def test_bart_pretraining_and_finetuning_in_half_precision_track_fp32(bart):
    _, pretrain, finetune, _ = bart
    _tracks_fp32(pretrain, 0.05)
    _tracks_fp32(finetune, 0.05)
    ref = losses(finetune["fp32"])
    assert ref[-1] < ref[0] - 0.15  # it learns (6.46 -> 6.24)


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_bart_finetuning_resumed_trains_as_the_uninterrupted_one(bart, name):
    """--finetune-from-model, stopped and run again, equals --restore-file with the resets."""
    _, _, finetune, resumed = bart
    first, rest = resumed[name]
    assert len(first) == CUT and len(rest) == UPDATES - CUT
    assert first + rest == finetune[name]


def test_bart_finetuned_checkpoint_decodes_in_half_precision(bart, toy_data):
    root, _, _, _ = bart
    _decodes_as_fp32(toy_data, root / "fp16" / "checkpoint_last.pt", FINETUNE[:2])
