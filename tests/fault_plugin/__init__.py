"""A --user-dir for the reliability tests: the plugin plus faults injected on purpose.

``--user-dir tests/fault_plugin`` loads fairseq_fp16 (everything it registers)
and adds the criterion ``faulty_label_smoothed_cross_entropy``:

* ``--fault nan-loss``: the loss of the training forward is NaN;
* ``--fault grad-overflow``: the loss is multiplied by 2^100 (finite in fp32,
  but its gradients overflow fp16);
* ``--fault scale-module --fault-module NAME --fault-factor F``: the weights of
  module NAME are multiplied by F once (a corruption that persists);

at training forward number ``--fault-at`` (1-based), then every
``--fault-every`` forwards (0 = once); with ``--fault-rank R`` only on
distributed rank R.

Environment ``FAULT_DUMP_DIR=DIR``: at exit each process writes
``DIR/rank<R>.json`` with a SHA-256 of its model's parameters.

Environment ``FAULT_KILL_IN_COPY=N``: SIGKILL this process half-way through
the N-th copy of a checkpoint to ``checkpoint_last.pt``.
``FAULT_STOCK_COPY=1``: copy checkpoints with fairseq's own in-place copy
(what stock fairseq does), to show what the plugin's atomic copy prevents.
"""

import atexit
import hashlib
import json
import os
import shutil
import signal
from dataclasses import dataclass, field

import torch
from fairseq import checkpoint_utils
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)

import fairseq_fp16  # noqa: F401  (registers the plugin; installs its patches)
from fairseq_fp16.patches import REGISTRY
from fairseq_fp16.core.ranks import rank


@dataclass
class FaultyConfig(LabelSmoothedCrossEntropyCriterionConfig):
    fault: str = field(default="none", metadata={"help": "nan-loss, grad-overflow or scale-module"})
    fault_at: int = field(default=0, metadata={"help": "training forward number of the first fault"})
    fault_every: int = field(default=0, metadata={"help": "repeat every N forwards (0 = once)"})
    fault_module: str = field(default="", metadata={"help": "module for scale-module"})
    fault_factor: float = field(default=1e5, metadata={"help": "weight factor for scale-module"})
    fault_rank: int = field(default=-1, metadata={"help": "inject only on this rank (-1 = all)"})


@register_criterion("faulty_label_smoothed_cross_entropy", dataclass=FaultyConfig)
class FaultyCriterion(LabelSmoothedCrossEntropyCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0,
                 report_accuracy=False, fault="none", fault_at=0, fault_every=0,
                 fault_module="", fault_factor=1e5, fault_rank=-1):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        self.fault, self.fault_at, self.fault_every = fault, fault_at, fault_every
        self.fault_module, self.fault_factor = fault_module, fault_factor
        self.fault_rank = fault_rank
        self.rank = rank()  # built after the distributed start-up; the group is gone at exit
        self.forwards = 0
        self.model = None
        if os.environ.get("FAULT_DUMP_DIR"):
            atexit.register(self._dump)

    def _dump(self) -> None:
        if self.model is None:
            return
        h = hashlib.sha256()
        for name, p in sorted(self.model.state_dict().items()):
            h.update(name.encode())
            h.update(p.detach().float().cpu().numpy().tobytes())
        path = os.path.join(os.environ["FAULT_DUMP_DIR"], f"rank{self.rank}.json")
        with open(path, "w") as f:
            json.dump({"rank": self.rank, "forwards": self.forwards, "sha256": h.hexdigest()}, f)

    def _due(self) -> bool:
        n = self.forwards
        if self.fault == "none" or self.fault_at <= 0 or n < self.fault_at:
            return False
        if self.fault_rank >= 0 and self.rank != self.fault_rank:
            return False
        if n == self.fault_at:
            return True
        return self.fault_every > 0 and (n - self.fault_at) % self.fault_every == 0

    def forward(self, model, sample, reduce=True):
        due = False
        self.model = model
        if model.training:
            self.forwards += 1
            due = self._due()
        if due and self.fault == "scale-module":
            module = dict(model.named_modules())[self.fault_module]
            with torch.no_grad():
                module.weight.mul_(self.fault_factor)
        loss, sample_size, logging_output = super().forward(model, sample, reduce)
        if due and self.fault == "nan-loss":
            loss = loss * float("nan")
        elif due and self.fault == "grad-overflow":
            loss = loss * 2.0**100
        return loss, sample_size, logging_output


def _install_copy_faults() -> None:
    if os.environ.get("FAULT_STOCK_COPY") == "1":
        checkpoint_utils.PathManager = REGISTRY.original("fairseq.checkpoint_utils:PathManager")
    kill_at = int(os.environ.get("FAULT_KILL_IN_COPY", "0"))
    if not kill_at:
        return
    real_copyfile = shutil.copyfile
    seen = {"n": 0}

    def copyfile(src, dst, *args, **kwargs):
        if os.path.basename(dst).startswith("checkpoint_last.pt"):
            seen["n"] += 1
            if seen["n"] == kill_at:
                with open(src, "rb") as f:
                    data = f.read()
                with open(dst, "wb") as f:
                    f.write(data[: len(data) // 2])
                    f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        return real_copyfile(src, dst, *args, **kwargs)

    shutil.copyfile = copyfile


_install_copy_faults()
