"""Patches of fairseq's data loading: a damaged or mismatched data-bin is refused as a split
loads, naming the file and what is wrong with it, instead of failing inside numpy or at an
embedding lookup during the first steps.

fairseq-preprocess writes each split as ``PREFIX.idx`` (a header, then each sentence's length
and byte offset) and ``PREFIX.bin`` (the token ids). :func:`check_split` reads the index and
compares it with the files' sizes (a cost of one ``stat``); :func:`check_token_ids` compares the
largest token id with the dictionary's size (one pass over the ids, at memory speed).
"""

from __future__ import annotations

import inspect
import os
import struct
from pathlib import Path
from typing import Optional, Tuple

import numpy as np

from .registry import Patch
from .registry import original as _original

__all__ = ["PATCHES", "check_split", "check_token_ids"]

MAGIC = b"MMIDIDX\x00\x00"
HEADER = len(MAGIC) + 8 + 1 + 8  # magic, version, dtype code, number of sentences
MMAP_INIT = "fairseq.data.indexed_dataset:MMapIndexedDataset._do_init"
LOAD = "fairseq.data.data_utils:load_indexed_dataset"
REMEDY = "re-run fairseq-preprocess for this split"


def _header(prefix: str) -> Optional[Tuple[np.dtype, int]]:
    """The token dtype and sentence count of ``PREFIX.idx``, its size checked against them (None:
    not an index of fairseq's mmap format, which fairseq's own reader refuses)."""
    from fairseq.data.indexed_dataset import _code_to_dtype

    idx = prefix + ".idx"
    with open(idx, "rb") as f:
        head = f.read(HEADER)
    if len(head) < HEADER or not head.startswith(MAGIC) or head[17] not in _code_to_dtype:
        return None
    (count,) = struct.unpack("<Q", head[18:HEADER])
    size, want = os.path.getsize(idx), HEADER + 12 * count
    if size != want:
        raise ValueError(f"{idx} has {size:,} bytes where its header's {count:,} sentences need "
                         f"{want:,}: the index is truncated or damaged; {REMEDY}")
    return np.dtype(_code_to_dtype[head[17]]), count


def _lengths_and_offsets(prefix: str, count: int, first: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """The lengths and byte offsets of sentences ``first``.. of a checked ``PREFIX.idx``."""
    idx, n = prefix + ".idx", count - first
    return (np.fromfile(idx, dtype=np.int32, count=n, offset=HEADER + 4 * first),
            np.fromfile(idx, dtype=np.int64, count=n, offset=HEADER + 4 * count + 8 * first))


def check_split(prefix: str) -> None:
    """Refuse a split whose ``.bin`` is empty or shorter than its ``.idx`` says (the last
    sentence's end is read; the whole index only when the file is short).

    Raises:
        ValueError: naming the file, its size, what the index needs and the first sentence
            (the line of the text fairseq-preprocess read) that is missing.
    """
    header = _header(prefix)
    if header is None:
        return
    dtype, count = header
    path = prefix + ".bin"
    have = os.path.getsize(path)
    if have == 0:
        raise ValueError(f"{path} is empty ({count:,} sentences in its index): the split has no "
                         f"tokens; fairseq-preprocess wrote it from an empty text file, or {REMEDY}")
    sizes, pointers = _lengths_and_offsets(prefix, count, max(count - 1, 0))
    ends = pointers + sizes.astype(np.int64) * dtype.itemsize
    if len(ends) and ends[-1] > have:
        sizes, pointers = _lengths_and_offsets(prefix, count)
        first = int(np.argmax(pointers + sizes.astype(np.int64) * dtype.itemsize > have))
        raise ValueError(f"{path} has {have:,} bytes where its index ({prefix}.idx) needs "
                         f"{int(ends[-1]):,}: the file is truncated from sentence {first + 1:,} "
                         f"(line {first + 1:,} of the text fairseq-preprocess read) on; {REMEDY}")


def _dictionary_file(prefix: str) -> str:
    """The dictionary fairseq-preprocess wrote beside the split (``dict.LANG.txt`` for
    ``train.src-tgt.LANG``, else ``dict.txt``), as words for a message."""
    folder, name = Path(prefix).parent, Path(prefix).name
    lang = [f"dict.{name.rsplit('.', 1)[1]}.txt"] if "." in name else []
    for candidate in (folder / n for n in [*lang, "dict.txt"]):
        if candidate.exists():
            return str(candidate)
    return "the task's dictionary"


def check_token_ids(prefix: str, entries: int) -> None:
    """Refuse a split with a token id at or beyond the dictionary's ``entries``.

    Raises:
        ValueError: naming the file, the id, its sentence and the dictionary.
    """
    header = _header(prefix)
    if header is None or header[1] == 0:
        return
    dtype, count = header
    ids = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
    if int(ids.max()) < entries:
        return
    at = int(np.argmax(ids >= entries))
    _, pointers = _lengths_and_offsets(prefix, count)
    sentence = int(np.searchsorted(pointers, at * dtype.itemsize, side="right"))
    raise ValueError(f"{prefix}.bin: token id {int(ids[at]):,} in sentence {sentence:,} (line "
                     f"{sentence:,} of the text fairseq-preprocess read) is beyond the "
                     f"{entries:,} entries of {_dictionary_file(prefix)}: the data was made with "
                     "another dictionary; restore the dictionary fairseq-preprocess wrote, or "
                     f"{REMEDY}")


def _do_init(self, path):
    check_split(path)
    return _original(MMAP_INIT)(self, path)


def _load_indexed_dataset(path, dictionary=None, dataset_impl=None, combine=False, default="cached"):
    dataset = _original(LOAD)(path, dictionary, dataset_impl, combine, default)
    if dataset is not None and dictionary is not None:
        k = 0
        while k == 0 or combine:  # fairseq's combine loads PATH, PATH1, PATH2, ... while they exist
            prefix = path + (str(k) if k else "")
            if not (os.path.exists(prefix + ".idx") and os.path.exists(prefix + ".bin")):
                break
            check_token_ids(prefix, len(dictionary))
            k += 1
    return dataset


PATCHES = [
    Patch(MMAP_INIT, group="repair", replacement=_do_init,
          expects=["self._index = self.Index(index_file_path(self._path))",
                   "self._bin_buffer_mmap = np.memmap("],
          why="a truncated .bin or .idx fails at the first batch that reaches the missing bytes "
              "(numpy's 'offset must be non-negative', 'buffer is smaller than requested "
              "size') and an empty one with 'cannot mmap an empty file'; the files' sizes are "
              "checked against the index as the split loads, naming the file and the sentence"),
    Patch(LOAD, group="repair", replacement=_load_indexed_dataset,
          expects=["dataset = indexed_dataset.make_dataset("],
          condition=lambda fn: None if list(inspect.signature(fn).parameters) == [
              "path", "dictionary", "dataset_impl", "combine", "default"] else "its arguments changed",
          why="a split made with another dictionary fails at the first embedding lookup of an id "
              "beyond it ('index out of range in self', and a crash.pt); each loaded split's "
              "largest token id is compared with the dictionary's size, naming the file, the "
              "sentence and the dictionary"),
]
