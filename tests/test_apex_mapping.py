"""docs/apex-recipe.md's schedule mapping: BERT's ``warmup_linear`` is fairseq's ``polynomial_decay``.

The classic apex/BERT fine-tuning loop (NVIDIA DeepLearningExamples,
``PyTorch/LanguageModeling/BERT/optimization.py`` and ``run_squad.py``) sets, before the
update that follows ``global_step`` updates,

    lr_this_step = lr * warmup_linear(global_step / t_total, warmup_proportion)

with ``warmup_linear(x, w) = x / w`` while ``x < w``, else ``max((x - 1) / (w - 1), 0)``:
a linear ramp from 0 to ``lr`` over the first ``w * t_total`` updates, then a linear decay to
0 at ``t_total``. fairseq's trainer calls ``lr_scheduler.step_update(num_updates)`` after each
update, and the rate it sets is the next update's, so the two agree when, after ``n`` updates,
``step_update(n)`` returns ``lr * warmup_linear(n / T, W / T)``. The flags are parsed by
fairseq's own option parser, as ``fairseq-train`` parses them.
"""

import pytest
from fairseq import options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.optim import FairseqOptimizer
from fairseq.optim.lr_scheduler import build_lr_scheduler

LR, WARMUP, TOTAL = 5e-5, 100, 1000  # BERT fine-tuning: warmup_proportion 0.1


def warmup_linear(x: float, warmup: float) -> float:
    """NVIDIA's BERT schedule (see the module docstring), written from its definition."""
    return x / warmup if x < warmup else max((x - 1.0) / (warmup - 1.0), 0.0)


class RecordingOptimizer(FairseqOptimizer):
    """Just what a scheduler touches: the learning rate it sets and reads back."""

    def __init__(self):
        super().__init__(cfg=None)
        self.lr = None

    def set_lr(self, lr):
        self.lr = lr

    def get_lr(self):
        return self.lr


def scheduler(*flags):
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [
        "data-bin", "--arch", "transformer", "--optimizer", "adam", "--lr", str(LR),
        "--lr-scheduler", "polynomial_decay", "--warmup-updates", str(WARMUP),
        "--total-num-update", str(TOTAL), *flags])
    cfg = convert_namespace_to_omegaconf(args)
    return build_lr_scheduler(cfg.lr_scheduler, RecordingOptimizer())


def schedule(sched, updates):
    return [sched.step_update(n) for n in updates]


UPDATES = range(0, TOTAL + 50)  # past the end too: both hold 0


def test_polynomial_decay_power_1_is_berts_warmup_linear_at_every_update():
    sched = scheduler("--power", "1", "--end-learning-rate", "0")
    expected = [LR * warmup_linear(n / TOTAL, WARMUP / TOTAL) for n in UPDATES]
    assert schedule(sched, UPDATES) == pytest.approx(expected, rel=1e-9, abs=1e-15)
    # the shape: 0 at the start, the peak at the end of the warm-up, 0 from TOTAL on
    assert (sched.step_update(0), sched.step_update(WARMUP), sched.step_update(TOTAL)) == (0.0, LR, 0.0)


@pytest.mark.parametrize("flags", [("--power", "2", "--end-learning-rate", "0"),
                                   ("--power", "1", "--end-learning-rate", str(LR / 10))])
def test_other_flags_are_not_warmup_linear(flags):
    # a wrong mapping fails: the warm-up still matches, the decay does not
    got = schedule(scheduler(*flags), UPDATES)
    expected = [LR * warmup_linear(n / TOTAL, WARMUP / TOTAL) for n in UPDATES]
    assert got[:WARMUP + 1] == pytest.approx(expected[:WARMUP + 1], rel=1e-9, abs=1e-15)
    assert got != pytest.approx(expected, rel=1e-3, abs=1e-12)
