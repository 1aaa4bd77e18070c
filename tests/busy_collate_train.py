"""fairseq-train whose batch collation keeps the prefetch thread inside torch.

``python busy_collate_train.py ARGS`` runs ``fairseq-train ARGS`` after making
``LanguagePairDataset.collater`` do a few large matrix products first, so that
when training ends, fairseq's prefetch thread is almost surely inside a torch
call: the timing behind the abort at exit that fairseq_fp16.patches.prefetch removes.
"""

import functools
import sys

import torch
from fairseq.data import language_pair_dataset

_collater = language_pair_dataset.LanguagePairDataset.collater


@functools.wraps(_collater)  # the plugin checks the wrapped collater's source
def _busy_collater(self, samples, **kwargs):
    a = torch.randn(1200, 1200)
    for _ in range(3):
        a = a @ a / 1200
    return _collater(self, samples, **kwargs)


if __name__ == "__main__":
    language_pair_dataset.LanguagePairDataset.collater = _busy_collater
    from fairseq_cli.train import cli_main

    sys.argv[0] = "fairseq-train"
    cli_main()
