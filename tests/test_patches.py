"""fairseq_fp16.patches: every change to fairseq in one registry, checked against the installed
fairseq, installed and uninstalled together."""

import os
import re
import subprocess
import sys
import textwrap

import pytest

import fairseq_fp16  # noqa: F401  (installs the patches)
from fairseq import checkpoint_utils, options
from fairseq import trainer as fairseq_trainer
from fairseq.tasks.fairseq_task import FairseqTask
from fairseq_fp16 import patches
from fairseq_fp16.patches import REGISTRY, Patch
from fairseq_fp16.patches.registry import Registry

REPLACED = [p for p in REGISTRY.patches if p.replacement is not None]


def test_uninstall_restores_every_original_and_install_puts_every_replacement_back():
    assert patches.is_installed() and len(REPLACED) >= 15
    originals = {p.target: p.original for p in REPLACED}
    patches.install()  # idempotent
    assert {p.target: p.original for p in REPLACED} == originals
    patches.uninstall()
    try:
        assert not patches.is_installed()
        for p in REPLACED:
            assert p.current() is originals[p.target], p.target
    finally:
        patches.install()
    for p in REPLACED:
        assert p.current() is p.replacement, p.target
    assert fairseq_trainer.Trainer.train_step is patches.trainer._train_step
    assert options.parse_args_and_arch is patches.options._parse_args_and_arch


def test_each_target_is_patched_once_and_every_patch_says_why():
    targets = [p.target for p in REGISTRY.patches]
    assert len(targets) == len(set(targets))
    assert all(p.group in ("repair", "precision") and len(p.why) > 40 for p in REGISTRY.patches)
    with pytest.raises(ValueError, match="fairseq.trainer:Trainer.train_step is patched twice"):
        REGISTRY.add(Patch("fairseq.trainer:Trainer.train_step", why="again", group="repair"))
    with pytest.raises(ValueError, match="group must be one of"):
        Patch("fairseq.trainer:Trainer.x", why="", group="feature")
    table = patches.describe().split("\n\n")[0].splitlines()
    assert table[0] == "| fairseq | group | kind | why |" and len(table) == len(targets) + 2
    groups = [row.split(" | ")[1] for row in table[2:]]
    assert groups == sorted(groups, key=("repair", "precision").index)  # repairs first


def test_atomic_copy_replaces_the_destination_whole(tmp_path):
    src, dst = tmp_path / "a.pt", tmp_path / "checkpoint_last.pt"
    src.write_bytes(b"new" * 1000)
    dst.write_bytes(b"old")
    assert checkpoint_utils.PathManager.copy(str(src), str(dst), overwrite=True)
    assert dst.read_bytes() == b"new" * 1000 and not (tmp_path / "checkpoint_last.pt.tmp").exists()
    assert not checkpoint_utils.PathManager.copy(str(src), str(dst), overwrite=False)
    assert checkpoint_utils.PathManager.isfile(str(dst))  # everything else delegates


def test_fairseq_is_what_every_patch_expects():
    REGISTRY.check()


def test_a_changed_fairseq_is_refused_before_anything_is_installed(monkeypatch):
    patches.uninstall()

    def _build_optimizer(self):
        self._optimizer = None  # no FP16Optimizer any more

    monkeypatch.setattr(fairseq_trainer.Trainer, "_build_optimizer", _build_optimizer)
    try:
        with pytest.raises(RuntimeError, match=re.escape(
                "fairseq_fp16: fairseq.trainer:Trainer._build_optimizer changed "
                "('optim.FP16Optimizer.build_optimizer(self.cfg, params)' not found); "
                "this plugin supports fairseq 0.12")):
            patches.install()
        assert not any(p.installed for p in REGISTRY.patches)
        assert fairseq_trainer.Trainer.train_step is not patches.trainer._train_step
    finally:
        monkeypatch.undo()
        patches.install()
    assert patches.is_installed()


def test_a_changed_signature_is_refused(monkeypatch):
    patches.uninstall()

    def get_batch_iterator(self, dataset, max_tokens=None, seed=1, max_sentences=None):
        with data_utils.numpy_seed(seed + epoch):  # noqa: F821  (source text only)
            indices = dataset.ordered_indices()  # noqa: F841

    monkeypatch.setattr(FairseqTask, "get_batch_iterator", get_batch_iterator)
    try:
        with pytest.raises(RuntimeError, match=r"FairseqTask.get_batch_iterator changed \(seed is not "
                                               r"argument 5 after dataset"):
            patches.install()
    finally:
        monkeypatch.undo()
        patches.install()


def test_a_patch_restores_what_it_replaced_on_a_class_and_a_module():
    import types

    module = types.ModuleType("fake_fairseq_module")

    class Owner:
        def method(self):
            return "original"

    module.Owner, module.value = Owner, 1
    sys.modules["fake_fairseq_module"] = module
    try:
        registry = Registry()
        registry.add(Patch("fake_fairseq_module:Owner.method", why="w", group="repair",
                           replacement=lambda self: "patched", expects=['return "original"']))
        registry.add(Patch("fake_fairseq_module:value", why="w", group="repair", replacement=2))
        registry.install()
        assert Owner().method() == "patched" and module.value == 2
        assert registry.original("fake_fairseq_module:Owner.method")(None) == "original"
        registry.uninstall()
        assert Owner().method() == "original" and module.value == 1 and not registry.installed
    finally:
        del sys.modules["fake_fairseq_module"]


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


def _checkpoints(folder, saved):
    """Checkpoint files of (name, num_updates or None for damaged bytes), oldest first."""
    import torch

    for age, (name, updates) in enumerate(reversed(saved)):
        path = folder / name
        if updates is None:
            path.write_bytes(b"damaged" * 100)
        else:
            torch.save({"optimizer_history": [{"num_updates": updates}]}, path)
        os.utime(path, (1e9 - age, 1e9 - age))


def _fake_trainer_load(loaded):
    """fairseq's Trainer.load_checkpoint as the fallback sees it: a damaged file raises, a missing
    one starts afresh (None), an intact one loads."""
    from fairseq_fp16.patches.checkpoints import DamagedCheckpointError

    def load(self, filename, *args, **kwargs):
        if not os.path.exists(filename):
            loaded.append(None)
            return None
        with open(filename, "rb") as f:
            if f.read(7) == b"damaged":
                raise DamagedCheckpointError(f"fairseq_fp16: checkpoint {filename} is truncated or corrupt (EOFError: x)")
        loaded.append(os.path.basename(filename))
        return {"file": os.path.basename(filename)}

    return load


def test_a_truncated_checkpoint_last_falls_back_to_the_most_updates_on_every_rank(tmp_path, monkeypatch, caplog):
    """checkpoint_best.pt saved at update 7 (as the lost checkpoint_last.pt) wins over the newer
    file checkpoint_2_6.pt; a damaged candidate is passed over; two ranks reading the file in turn
    (--load-checkpoint-on-all-dp-ranks) both resume from it."""
    from fairseq_fp16.patches import checkpoints as ck

    _checkpoints(tmp_path, [("checkpoint_best.pt", 7), ("checkpoint_2_6.pt", 6), ("checkpoint_1_5.pt", 5),
                            ("checkpoint_2_8.pt", None), ("checkpoint_last.pt", None)])
    assert [(os.path.basename(p), u) for p, u in ck.intact_alternatives(str(tmp_path / "checkpoint_last.pt"))] == [
        ("checkpoint_best.pt", 7), ("checkpoint_2_6.pt", 6), ("checkpoint_1_5.pt", 5), ("checkpoint_2_8.pt", None)]
    loaded = []
    monkeypatch.setattr(ck, "_original", lambda target: _fake_trainer_load(loaded))
    with caplog.at_level("WARNING"):
        for rank in (0, 1):
            assert ck._load_checkpoint_or_an_intact_one(None, str(tmp_path / "checkpoint_last.pt")) == \
                {"file": "checkpoint_best.pt"}
    assert loaded == ["checkpoint_best.pt", "checkpoint_best.pt"]
    assert "resumed from checkpoint_best.pt (update 7), the intact checkpoint beside it with the most updates" \
        in caplog.text
    assert (tmp_path / "checkpoint_last.pt.damaged").read_bytes() == b"damaged" * 100
    assert sorted(p.name for p in tmp_path.iterdir() if ".tmp" in p.name) == []


def test_every_patch_checks_the_fairseq_it_was_written_for():
    assert [p.target for p in REGISTRY.patches if not p.expects and p.condition is None] == []


@pytest.mark.parametrize("target,other", [
    ("fairseq.data.iterators:_sentinel", None),
    ("fairseq.models.distributed_fairseq_model:DistributedDataParallel", object),
    ("fairseq.checkpoint_utils:PathManager", object()),
])
def test_a_condition_tells_another_object_from_fairseqs(target, other):
    patch = REGISTRY.get(target)
    assert patch.condition(patch.original) is None
    assert patch.condition(other)  # says what differs


def test_describe_lists_the_process_wide_settings_with_their_values():
    from fairseq_fp16.core.compile import RECOMPILE_LIMIT, compile_training_forward
    import torch._dynamo

    settings = dict(row.split(" | ")[0::3] for row in patches.describe().split("\n\n")[1].splitlines()[2:])
    assert settings["| torch's weights-only allow-list"] == "argparse.Namespace |"
    compile_training_forward([torch.nn.Linear(2, 2)], backend="eager")
    settings = dict(row.split(" | ")[0::3] for row in patches.describe().split("\n\n")[1].splitlines()[2:])
    assert settings["| torch._dynamo.config.recompile_limit"] == f"{torch._dynamo.config.recompile_limit} |"
    assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT
