"""fairseq-train and fairseq-generate run in the test process (a fraction of a second for the
tiny model, against seconds for a CLI run): what fairseq's own tests do (``train.main(cfg)``),
with a hook on the trainer as a checkpoint is loaded, and stock fairseq runs with the plugin's
patches taken out for their duration."""

import contextlib
import io
import logging
from typing import Callable, Optional, Sequence

from fairseq import checkpoint_utils, options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq_cli import generate as generate_cli
from fairseq_cli import train as train_cli

from fairseq_fp16.patches import REGISTRY


@contextlib.contextmanager
def _stock_fairseq():
    """fairseq as it is without the plugin (its patches uninstalled, then installed again)."""
    REGISTRY.uninstall()
    try:
        yield
    finally:
        REGISTRY.install()


@contextlib.contextmanager
def _on_load(hook: Optional[Callable]):
    """Call ``hook(trainer, extra_state)`` when fairseq-train has loaded its checkpoint."""
    if hook is None:
        yield
        return
    load = checkpoint_utils.load_checkpoint

    def load_and_look(cfg, trainer, **kwargs):
        extra_state, epoch_itr = load(cfg, trainer, **kwargs)
        hook(trainer, extra_state)
        return extra_state, epoch_itr

    checkpoint_utils.load_checkpoint = load_and_look
    try:
        yield
    finally:
        checkpoint_utils.load_checkpoint = load


@contextlib.contextmanager
def _quiet():
    """fairseq's INFO logs off (it logs each update and its whole config)."""
    previous = logging.root.manager.disable
    logging.disable(logging.INFO)
    try:
        yield
    finally:
        logging.disable(previous)


def fairseq_train(args: Sequence[str], stock: bool = False, on_load: Optional[Callable] = None) -> None:
    """``fairseq-train ARGS`` in this process; ``stock``: without the plugin's patches (ARGS then
    name no --user-dir); ``on_load(trainer, extra_state)`` runs once the checkpoint (if any) is
    loaded, before the first update."""
    with contextlib.ExitStack() as stack:
        if stock:
            stack.enter_context(_stock_fairseq())
        stack.enter_context(_on_load(on_load))
        stack.enter_context(_quiet())
        parser = options.get_training_parser()
        cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(parser, input_args=[str(a) for a in args]))
        train_cli.main(cfg)


def fairseq_generate(args: Sequence[str]) -> str:
    """``fairseq-generate ARGS`` in this process; returns what it prints (the S-, T-, H- and P-
    lines and the BLEU line)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), _quiet():
        parser = options.get_generation_parser()
        generate_cli.main(options.parse_args_and_arch(parser, input_args=[str(a) for a in args]))
    return out.getvalue()
