"""A mixed-precision run's checkpoints: the exact fp32 master weights exported into the model
(``scripts/export_fp32_checkpoint.py``, :data:`EXPORT_DOC`), the weights of a run's last
checkpoints averaged, a half run's from its fp32 masters (``scripts/average_checkpoints.py``,
:data:`AVERAGE_DOC`), and a run's counters at its end (:func:`run_end`, for ``compare.py``).

Imports torch and the plugin (``fairseq_fp16`` registers the task and allow-lists fairseq's
globals for ``torch.load``).
"""

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import torch

import fairseq_fp16  # noqa: F401  (registers the task; allow-lists fairseq's globals for torch.load)
from fairseq_fp16.patches.checkpoints import unreadable
from fairseq_fp16.precision import NAMES, Precision

#: scripts/export_fp32_checkpoint.py's help
EXPORT_DOC = """Write a copy of a mixed-precision checkpoint whose model weights are the exact fp32 masters.

    python scripts/export_fp32_checkpoint.py IN.pt OUT.pt [--data DIR]

A checkpoint of an ``--fp16``/``--bf16`` run holds the model's weights as the
half model had them, rounded to fp16 or bf16 (fairseq saves them widened to
fp32), and the fp32 master weights the optimizer updates in its state
(``last_optimizer_state["master_params"]``, keyed by parameter position).
``fairseq-generate``, ``--finetune-from-model``, ``--reset-optimizer`` and
fairseq's ``scripts/average_checkpoints.py`` read only the model's weights
(this project's ``scripts/average_checkpoints.py`` averages the masters).
OUT is IN with every half-trained weight replaced by its master (under each
name the weight has, e.g. all three of a ``--share-all-embeddings`` table);
everything else, the optimizer state included, is kept, so OUT also resumes
training exactly as IN does.

The model is rebuilt from the checkpoint's own configuration to map positions
to names (its task loads the dictionaries from the data directory it was
trained on; ``--data`` points elsewhere). Each master is checked to round to the
weight IN holds: a checkpoint whose masters do not fit its model is refused, and so is
one exported already (its weights are its masters: there is nothing left to export).
"""
#: scripts/average_checkpoints.py's help
AVERAGE_DOC = """Average the weights of a run's last checkpoints into one checkpoint to decode.

    python scripts/average_checkpoints.py OUT.pt IN.pt [IN.pt ...] [--data DIR]
    python scripts/average_checkpoints.py OUT.pt --last N --dir SAVE_DIR [--data DIR]
    ... [--summary OUT.json]

``--last N`` takes the N interval checkpoints of SAVE_DIR with the most updates
(``checkpoint_<epoch>_<updates>.pt``, written by ``--save-interval-updates``; keep
them with ``--keep-interval-updates N`` or more).

Averaging the weights of the last checkpoints is the decoding recipe of the
Transformer paper (Vaswani et al., 2017: the last 5 checkpoints, written every
10 minutes, for the base model) and of fairseq's ``scripts/average_checkpoints.py``.
On a run still learning at a high learning rate, as this project's CPU recipes
are, the average also lies closer to where the optimizer is heading than the
last step's weights do, which makes it less sensitive to the few last updates.

What this script does that fairseq's does not: a checkpoint of a ``--fp16`` or
``--bf16`` run is averaged from its fp32 master weights
(``last_optimizer_state["master_params"]``, each checked to round to the
model's weight), not from the weights the half model held, which are rounded to
fp16 or bf16; the sum is taken in float64. All inputs must be of one precision
and hold the same tensors.

OUT is the last (most updates) input with its ``model`` replaced by the average,
in fp32, and ``last_optimizer_state`` removed: the Adam moments and masters
belong to none of the averaged weights. ``fairseq-generate`` decodes OUT as any
checkpoint (``--fp16``/``--bf16`` round the averaged weights to the half model);
``--restore-file OUT`` starts a new optimizer from the averaged weights.
``--summary`` writes what was averaged as JSON (``average``'s return value and
the input paths): ``scripts/compare.py`` reads it.
"""

def parameter_names(model: torch.nn.Module) -> List[List[str]]:
    """Every state-dict name of each trainable parameter, in the trainer's order.

    fairseq's trainer (and the plugin's optimizer) number the parameters as
    ``model.named_parameters()`` lists those that require gradients: a shared
    tensor once. A shared tensor has several names in the state dict.
    """
    by_id: Dict[int, List[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(t), []).append(name)
    return [by_id[id(p)] for _, p in model.named_parameters() if p.requires_grad]


def saved_masters(state):
    """(:class:`~fairseq_fp16.precision.Precision`, fp32 masters by parameter position) a
    checkpoint's state holds; (None, None) when it holds none (an fp32 run, or one saved with
    ``--no-save-optimizer-state``)."""
    opt = state.get("last_optimizer_state")
    name = opt.get("precision") if isinstance(opt, dict) else None
    masters = opt.get("master_params") if isinstance(opt, dict) else None
    if name not in NAMES or not masters or not Precision(name).is_half:
        return None, None
    return Precision(name), masters


def read(path: Path, mmap: bool = False) -> Dict:
    """Checkpoint ``path``'s state, weights-only (``mmap``: the tensors stay on disk).

    Raises:
        ValueError: naming the file when its bytes are not a readable checkpoint.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:
        if not unreadable(e):
            raise
        first = str(e).strip().splitlines()[0].split(". ")[0][:200] if str(e).strip() else ""
        raise ValueError(f"{path} is not a readable checkpoint ({type(e).__name__}: {first}): the "
                         "file is truncated or damaged, or was not written by fairseq") from None


def load_masters(src: Path):
    """``src``'s state, its precision (fp16 or bf16) and fp32 masters by parameter position.

    Raises:
        ValueError: when ``src`` holds no fp32 masters (an fp32 run, or one saved with
            ``--no-save-optimizer-state``).
    """
    state = read(src)
    if not state.get("last_optimizer_state"):
        raise ValueError(f"{src} holds no optimizer state (saved with --no-save-optimizer-state?): "
                         "its fp32 master weights were not saved")
    precision, masters = saved_masters(state)
    if precision is None:
        opt = state["last_optimizer_state"]
        saved = opt.get("precision") if isinstance(opt, dict) else None
        raise ValueError(f"{src} holds no fp32 master weights (precision: {saved or 'fp32'}): "
                         "only a --fp16 or --bf16 run of the plugin's optimizer has them; an fp32 "
                         "run's weights are exact already")
    return state, precision, masters


def checkpoint_names(src: Path, data: str = None) -> List[List[str]]:
    """``parameter_names`` of the model ``src``'s own configuration builds (its task loads the
    dictionaries from the data directory it was trained on, or from ``data``).

    Raises:
        ValueError: when that data directory is not there.
    """
    from fairseq import checkpoint_utils

    overrides = {"data": data} if data else None
    try:
        models, _, _ = checkpoint_utils.load_model_ensemble_and_task([str(src)], arg_overrides=overrides)
    except FileNotFoundError as e:  # the data directory (a relative path is the training's)
        raise ValueError(f"{src}: its model needs the dictionaries of {e.filename!r}, which is not there "
                         "from here: pass --data DIR") from None
    return parameter_names(models[0])


def put_masters(src: Path, weights: Dict[str, torch.Tensor], precision: Precision, masters,
                names) -> Dict[str, int]:
    """Replace, in the model state dict ``weights``, every half-trained weight by its fp32 master.

    Returns ``replaced`` (tensors), ``names`` (state-dict entries written) and ``changed``
    (elements whose value differs from the weight ``weights`` held).

    Raises:
        ValueError: when a master does not round to the weight ``weights`` holds under its name;
            saying the checkpoint is already exported when that weight is the master itself.
    """
    half = precision.dtype
    replaced, written, changed = 0, 0, 0
    for i, master in sorted(masters.items(), key=lambda kv: int(kv[0])):
        i = int(i)
        if i >= len(names):  # a parameter of the criterion, not of the model
            continue
        for name in names[i]:
            saved = weights.get(name)
            if saved is None or saved.shape != master.shape or not torch.equal(
                    master.to(half).to(saved.dtype), saved):
                if saved is not None and saved.shape == master.shape and torch.equal(master, saved):
                    # the weight is its master, and no half value: the masters are in already
                    raise ValueError(f"{src} is already exported (scripts/export_fp32_checkpoint.py's "
                                     f"output): its model weights are the fp32 masters themselves "
                                     f"({name!r} is not rounded to {precision}), so it is an fp32 "
                                     "checkpoint with no masters left to export")
                raise ValueError(f"{src}: the fp32 master of parameter {i} does not round to the "
                                 f"model's weight {name!r}: the masters do not fit this model")
            changed += int((master != saved).sum())
            weights[name] = master.clone()
            written += 1
        replaced += 1
    return {"replaced": replaced, "names": written, "changed": changed}


def export(src: Path, dst: Path, data: str = None) -> Dict[str, object]:
    """Write ``dst``: ``src`` with its model weights replaced by the fp32 masters.

    Returns a summary: ``precision``, ``replaced`` (tensors), ``names`` (state-dict
    entries written) and ``changed`` (elements whose value differs from ``src``'s).

    Raises:
        ValueError: when ``src`` holds no fp32 masters (an fp32 run, or one saved with
            ``--no-save-optimizer-state``), or its masters do not fit its model.
    """
    state, precision, masters = load_masters(src)
    summary = put_masters(src, state["model"], precision, masters, checkpoint_names(src, data))
    torch.save(state, dst)
    return {"precision": precision.name, **summary}


def run_end(path: Path) -> Dict[str, object]:
    """A run's counters at its end, from its last checkpoint: ``updates`` (fairseq's
    ``num_updates``), ``skipped_updates`` and ``final_loss_scale``.

    The plugin's optimizer state holds ``num_skipped`` and its loss scaler's state (no scaler in
    fp32: the scale is None); stock fairseq's ``--fp16`` state holds ``loss_scale`` and no count
    of skipped updates (None). Both are None for a checkpoint saved without its optimizer state.
    """
    state = read(path, mmap=True)  # the tensors stay on disk
    opt = state.get("last_optimizer_state")
    opt = opt if isinstance(opt, dict) else {}
    if "precision" in opt:  # the plugin's MixedPrecisionFairseqOptimizer
        skipped, scale = opt.get("num_skipped"), (opt.get("scaler") or {}).get("scale")
    else:
        skipped, scale = None, opt.get("loss_scale")
    return {"updates": int(state["optimizer_history"][-1]["num_updates"]),
            "skipped_updates": None if skipped is None else int(skipped),
            "final_loss_scale": None if scale is None else float(scale)}


INTERVAL_CHECKPOINT = re.compile(r"checkpoint_(\d+)_(\d+)\.pt")


def last_interval_checkpoints(save_dir: Path, n: int) -> List[Path]:
    """The ``n`` interval checkpoints of ``save_dir`` with the most updates, oldest first.

    Raises:
        ValueError: when ``n`` < 1 or ``save_dir`` holds fewer than ``n`` of them.
    """
    if n < 1:
        raise ValueError(f"--last must be >= 1, got {n}")
    found = sorted((int(m[2]), p) for p in Path(save_dir).glob("checkpoint_*_*.pt")
                   if (m := INTERVAL_CHECKPOINT.fullmatch(p.name)))
    if len(found) < n:
        raise ValueError(f"{save_dir} holds {len(found)} interval checkpoint(s) "
                         f"(checkpoint_<epoch>_<updates>.pt), fewer than the {n} to average: train with "
                         f"--save-interval-updates K --keep-interval-updates {n}")
    return [p for _, p in found[-n:]]


def _weights(path: Path, names, data):
    """(state, precision, from masters, parameter names): a half run's weights are its fp32
    masters where it saved them, else the rounded weights its half model held."""
    state = read(path)
    precision, masters = saved_masters(state)
    if precision is not None:
        names = names or checkpoint_names(path, data)
        put_masters(path, state["model"], precision, masters, names)
        return state, precision, True, names
    common = (state.get("cfg") or {}).get("common") or {}
    return state, Precision.from_flags(bool(common.get("fp16")), bool(common.get("bf16"))), False, names


def _kind(precision: Precision, from_masters: bool) -> str:
    return precision.name + (" (fp32 masters)" if from_masters else " (no masters saved)" if precision.is_half else "")


def average(paths: Sequence[Path], dst: Path, data: str = None) -> Dict[str, object]:
    """Write ``dst``: the last of ``paths`` with its model weights the mean of all of theirs.

    Returns ``precision``, ``masters`` (True: a half run's fp32 masters were averaged;
    False: an fp32 run, or a half run saved without them, whose rounded weights were),
    ``n`` (checkpoints averaged), ``updates`` (each one's ``num_updates``) and ``tensors``
    (state-dict entries averaged).

    Raises:
        ValueError: when ``paths`` is empty or names a missing file, mixes precisions, or its
            checkpoints do not hold the same tensors (names, shapes, dtypes); when a half
            run's model cannot be built for lack of its data directory (pass ``data``).
    """
    if not paths:
        raise ValueError("no checkpoint to average")
    missing = [str(p) for p in paths if not Path(p).is_file()]
    if missing:
        raise ValueError(f"no such checkpoint: {', '.join(missing)}")
    names, total, first, state, updates = None, None, None, None, []
    for path in paths:
        state, prec, from_masters, names = _weights(Path(path), names, data)
        weights = state["model"]
        updates.append(state.get("optimizer_history", [{}])[-1].get("num_updates"))
        if total is None:
            precision, masters, first = prec, from_masters, path
            total = {k: v.to(torch.float64) if v.is_floating_point() else v.clone() for k, v in weights.items()}
            continue
        if (prec.name, from_masters) != (precision.name, masters):
            raise ValueError(f"{path} is an {_kind(prec, from_masters)} checkpoint, {first} an "
                             f"{_kind(precision, masters)} one: average the checkpoints of one run")
        if weights.keys() != total.keys():
            diff = sorted(weights.keys() ^ total.keys())
            raise ValueError(f"{path} and {first} hold different tensors (e.g. {diff[0]!r}): average the "
                             "checkpoints of one run")
        for k, v in weights.items():
            if v.shape != total[k].shape or v.is_floating_point() != total[k].is_floating_point():
                raise ValueError(f"{path}: {k!r} is {v.dtype} {tuple(v.shape)}, in {first} "
                                 f"{total[k].dtype} {tuple(total[k].shape)}: average the checkpoints of one run")
            if v.is_floating_point():
                total[k] += v.to(torch.float64)
            elif not torch.equal(v, total[k]):
                raise ValueError(f"{path}: the integer tensor {k!r} differs from {first}'s, so it cannot "
                                 "be averaged: average the checkpoints of one run")
    n = len(paths)
    state["model"] = {k: (v / n).to(torch.float32) if v.is_floating_point() else v for k, v in total.items()}
    state.pop("last_optimizer_state", None)
    torch.save(state, dst)
    return {"precision": precision.name, "masters": masters, "n": n, "updates": updates, "tensors": len(total)}


def export_main(argv=None) -> None:
    """The command line of scripts/export_fp32_checkpoint.py (:data:`EXPORT_DOC`)."""
    ap = argparse.ArgumentParser(description=EXPORT_DOC.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="checkpoint of a --fp16 or --bf16 run")
    ap.add_argument("dst", type=Path, help="where to write the copy with fp32 master weights")
    ap.add_argument("--data", help="data directory for the task's dictionaries "
                    "(default: the one the checkpoint was trained on)")
    a = ap.parse_args(argv)
    if a.dst.resolve() == a.src.resolve():
        ap.error("dst must differ from src (src's rounded weights stay the record of the half model)")
    try:
        s = export(a.src, a.dst, a.data)
    except ValueError as e:
        sys.exit(f"export_fp32_checkpoint: {e}")
    print(f"{a.dst}: {s['replaced']} {s['precision']} weights replaced by their fp32 masters "
          f"({s['names']} state-dict entries, {s['changed']:,} values changed)")


def average_main(argv=None) -> None:
    """The command line of scripts/average_checkpoints.py (:data:`AVERAGE_DOC`)."""
    ap = argparse.ArgumentParser(description=AVERAGE_DOC.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=AVERAGE_DOC)
    ap.add_argument("dst", type=Path, help="where to write the averaged checkpoint")
    ap.add_argument("src", type=Path, nargs="*", help="checkpoints of one run")
    ap.add_argument("--last", type=int, help="average the N interval checkpoints of --dir with the most updates")
    ap.add_argument("--dir", type=Path, help="a run's --save-dir (with --last)")
    ap.add_argument("--data", help="data directory for the task's dictionaries "
                    "(default: the one the checkpoints were trained on)")
    ap.add_argument("--summary", type=Path, help="write what was averaged to this JSON file")
    a = ap.parse_args(argv)
    if (a.last is None) == (not a.src):
        ap.error("give either checkpoints or --last N --dir SAVE_DIR")
    if a.last is not None and a.dir is None:
        ap.error("--last needs --dir SAVE_DIR")
    try:
        paths = a.src or last_interval_checkpoints(a.dir, a.last)
        if any(p.resolve() == a.dst.resolve() for p in paths):
            ap.error(f"dst {a.dst} is one of the checkpoints to average")
        s = average(paths, a.dst, a.data)
    except ValueError as e:
        sys.exit(f"average_checkpoints: {e}")
    if a.summary:
        a.summary.write_text(json.dumps({**s, "checkpoints": [str(p) for p in paths], "dst": str(a.dst)},
                                        indent=1) + "\n")
    print(f"{a.dst}: the mean of {s['n']} {s['precision']} checkpoints (updates "
          f"{', '.join(map(str, s['updates']))}; {s['tensors']} tensors"
          + (", from the fp32 masters)" if s["masters"] else
             ", from the rounded weights: no fp32 masters saved)" if s["precision"] != "fp32" else ")"))

