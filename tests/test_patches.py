"""The trainer hook: idempotent, reversible, and loud when fairseq's internals change."""

import re
import subprocess
import sys
import textwrap

import pytest

import fairseq_fp16  # noqa: F401  (installs the hook)
from fairseq import checkpoint_utils, options
from fairseq import trainer as fairseq_trainer
from fairseq_fp16 import trainer_hook


def test_install_is_idempotent_and_uninstall_restores_fairseq():
    cls = fairseq_trainer.Trainer
    ours = cls._build_optimizer
    trainer_hook.install()
    assert cls._build_optimizer is ours and trainer_hook.is_installed()
    trainer_hook.uninstall()
    try:
        assert cls._build_optimizer is trainer_hook._ORIGINALS["_build_optimizer"]
        assert cls.train_step is trainer_hook._ORIGINALS["train_step"]
        for module, name in [(checkpoint_utils, "load_checkpoint_to_cpu"), (checkpoint_utils, "PathManager"),
                             (options, "parse_args_and_arch")]:
            assert getattr(module, name) is trainer_hook._ORIGINALS[name], name
        for module, name, _ in trainer_hook._DISTRIBUTED_REPLACEMENTS:
            assert getattr(module, name) is trainer_hook._ORIGINALS[name], name
        assert not trainer_hook.is_installed()
    finally:
        trainer_hook.install()
    assert cls._build_optimizer is ours
    assert checkpoint_utils.PathManager.copy is trainer_hook._AtomicCopyPathManager.copy
    assert options.parse_args_and_arch is trainer_hook._parse_args_and_arch
    for module, name, ours in trainer_hook._DISTRIBUTED_REPLACEMENTS:
        assert getattr(module, name) is ours, name


def test_atomic_copy_replaces_the_destination_whole(tmp_path):
    src, dst = tmp_path / "a.pt", tmp_path / "checkpoint_last.pt"
    src.write_bytes(b"new" * 1000)
    dst.write_bytes(b"old")
    assert checkpoint_utils.PathManager.copy(str(src), str(dst), overwrite=True)
    assert dst.read_bytes() == b"new" * 1000 and not (tmp_path / "checkpoint_last.pt.tmp").exists()
    assert not checkpoint_utils.PathManager.copy(str(src), str(dst), overwrite=False)
    assert checkpoint_utils.PathManager.isfile(str(dst))  # everything else delegates


def test_fairseq_internals_are_as_expected():
    trainer_hook.check_fairseq_internals()


def test_changed_fairseq_internals_fail_loudly():
    class ChangedTrainer:
        def __init__(self, cfg, task, model, criterion, quantizer=None):
            self.tpu = cfg.common.tpu
            self._model = self._model.half()

        def _build_optimizer(self):
            self._optimizer = None  # no FP16Optimizer any more

    saved = dict(trainer_hook._ORIGINALS)
    trainer_hook._ORIGINALS.clear()
    try:
        with pytest.raises(RuntimeError, match=r"Trainer._build_optimizer changed .*FP16Optimizer"):
            trainer_hook.check_fairseq_internals(ChangedTrainer)
    finally:
        trainer_hook._ORIGINALS.update(saved)


def test_core_imports_without_fairseq(tmp_path):
    """The pure-torch core works in an environment where fairseq cannot be imported."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["fairseq"] = None  # any 'import fairseq' now fails
        import torch
        from fairseq_fp16.core import LossScaler, MixedPrecisionOptimizer, build_adam
        from fairseq_fp16.core import label_smoothed_nll_from_logits
        s = LossScaler(8.0, scale_window=1)
        s.update(torch.tensor(0.0))
        assert s.loss_scale == 16.0
        loss, nll = label_smoothed_nll_from_logits(torch.zeros(2, 4), torch.tensor([0, 1]), 0.0)
        assert abs(loss.item() - 2 * 1.3862944) < 1e-6  # 2 rows of log(4)
        assert not any(m.startswith("fairseq.") for m in sys.modules)
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_any_damaged_checkpoint_bytes_get_the_named_error(tmp_path):
    """Random bytes fail to unpickle in several ways (UnpicklingError, IndexError, KeyError,
    UnicodeDecodeError with torch 2.13); every one is reported as a damaged file, by name."""
    import random

    path = tmp_path / "checkpoint_last.pt"
    kinds = set()
    for seed in range(60):
        path.write_bytes(random.Random(seed).randbytes(4096))
        with pytest.raises(RuntimeError, match=rf"checkpoint {re.escape(str(path))} is truncated or corrupt "
                                               r"\((\w+): .*nothing was loaded or overwritten") as info:
            checkpoint_utils.load_checkpoint_to_cpu(str(path))
        kinds.add(re.search(r"\((\w+):", str(info.value)).group(1))
    assert {"UnpicklingError", "IndexError", "KeyError"} <= kinds


def test_errors_after_reading_are_not_called_damage(tmp_path):
    """A readable checkpoint that fails later (here: a KeyError in fairseq's upgrade step)
    keeps its own error; only failures inside torch's reader mean a damaged file."""
    import torch

    path = tmp_path / "checkpoint_last.pt"
    torch.save({"model": {}}, path)  # no "args"/"cfg": fairseq's upgrade step raises KeyError

    with pytest.raises(KeyError):
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
