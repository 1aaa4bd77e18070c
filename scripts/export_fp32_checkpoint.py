"""Write a copy of a mixed-precision checkpoint whose model weights are the exact fp32 masters.

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
weight IN holds: a checkpoint whose masters do not fit its model is refused.
"""

import argparse
import sys
from pathlib import Path
from typing import Dict, List

import torch

import fairseq_fp16  # noqa: F401  (registers the task; allow-lists fairseq's globals for torch.load)

HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


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
    """(precision, fp32 masters by parameter position) a checkpoint's state holds; (None, None)
    when it holds none (an fp32 run, or one saved with ``--no-save-optimizer-state``)."""
    opt = state.get("last_optimizer_state")
    precision = opt.get("precision") if isinstance(opt, dict) else None
    masters = opt.get("master_params") if isinstance(opt, dict) else None
    return (precision, masters) if precision in HALF_DTYPES and masters else (None, None)


def load_masters(src: Path):
    """``src``'s state and its precision ("fp16" or "bf16") and fp32 masters by parameter position.

    Raises:
        ValueError: when ``src`` holds no fp32 masters (an fp32 run, or one saved with
            ``--no-save-optimizer-state``).
    """
    state = torch.load(src, map_location="cpu", weights_only=True)
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


def put_masters(src: Path, weights: Dict[str, torch.Tensor], precision: str, masters, names) -> Dict[str, int]:
    """Replace, in the model state dict ``weights``, every half-trained weight by its fp32 master.

    Returns ``replaced`` (tensors), ``names`` (state-dict entries written) and ``changed``
    (elements whose value differs from the weight ``weights`` held).

    Raises:
        ValueError: when a master does not round to the weight ``weights`` holds under its name.
    """
    half = HALF_DTYPES[precision]
    replaced, written, changed = 0, 0, 0
    for i, master in sorted(masters.items(), key=lambda kv: int(kv[0])):
        i = int(i)
        if i >= len(names):  # a parameter of the criterion, not of the model
            continue
        for name in names[i]:
            saved = weights.get(name)
            if saved is None or saved.shape != master.shape or not torch.equal(
                    master.to(half).to(saved.dtype), saved):
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
    return {"precision": precision, **summary}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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


if __name__ == "__main__":
    main()
