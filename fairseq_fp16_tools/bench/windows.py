"""A window of updates of a fairseq-train run in this process, for the tools that watch some
of its updates (run_stats.py's profiler and census, op_census.py's census by kind)."""


def install_step_wrapper(train_module, wrap) -> None:
    """Wrap ``train_module.train`` (``fairseq_cli.train``'s epoch loop) so that the trainer it
    receives gets ``trainer.train_step = wrap(trainer, trainer.train_step)`` once: the instance's
    attribute, so the plugin's checks of fairseq's class see it unchanged. Several wrappers
    nest, the one installed last outermost."""
    train_epoch = train_module.train
    wrapped = []

    def train(cfg, trainer, *args, **kwargs):
        if not any(t is trainer for t in wrapped):
            wrapped.append(trainer)
            trainer.train_step = wrap(trainer, trainer.train_step)
        return train_epoch(cfg, trainer, *args, **kwargs)

    train_module.train = train



class UpdateWindow:
    """Updates ``first`` .. of a fairseq run, by ``Trainer.train_step`` calls.

    :meth:`install` wraps the ``train_step`` of the trainer that ``fairseq_cli.train.train``
    receives with the subclass's :meth:`wrap` (:func:`install_step_wrapper`).
    """

    FLAG = ""

    def __init__(self, first: int, count: int, out_path: str, name: str = "") -> None:
        if first < 1 or count < 1:
            raise ValueError(f"{self.FLAG} FIRST:COUNT needs FIRST >= 1 and COUNT >= 1, "
                             f"got {first}:{count}")
        self.first, self.count, self.out_path, self.name = first, count, out_path, name
        self.calls = 0
        self.summary = None

    def install(self, train_module) -> None:
        """Wrap ``train_module.train`` (``fairseq_cli.train``'s epoch loop)."""
        install_step_wrapper(train_module, self.wrap)

    def wrap(self, trainer, step):
        raise NotImplementedError
