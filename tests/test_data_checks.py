"""A damaged or mismatched data-bin is refused as its split loads, naming the file and what is
wrong (fairseq_fp16/patches/data.py), where fairseq failed inside numpy or at the first
embedding lookup."""

import re
import shutil
import struct

import numpy as np
import pytest

import fairseq_fp16  # noqa: F401  (installs the patches)
from fairseq.data import data_utils
from fairseq.data.dictionary import Dictionary
from fairseq.data.indexed_dataset import MMapIndexedDatasetBuilder
from fairseq_fp16.patches.data import check_split, check_token_ids

from conftest import train

SRC = "train.src-tgt.src"


@pytest.fixture
def data(toy_data, tmp_path):
    copy = tmp_path / "data"
    shutil.copytree(toy_data, copy)
    return copy


def _sizes(prefix):
    """The sentence lengths of fairseq's index PREFIX.idx (a 26-byte header ending in their count)."""
    (count,) = struct.unpack("<Q", open(f"{prefix}.idx", "rb").read(26)[18:])
    return np.fromfile(f"{prefix}.idx", dtype=np.int32, offset=26, count=count)


def _refused(data, tmp_path, pattern):
    proc, records = train(data, tmp_path / "ckpt", "--max-update", "2", check=False)
    assert proc.returncode != 0 and not records
    assert re.search(pattern, proc.stderr), proc.stderr[-3000:]
    assert not (tmp_path / "ckpt" / "crash.pt").exists()


def test_a_truncated_bin_is_refused_naming_the_file_and_the_first_missing_sentence(data, tmp_path):
    path = data / f"{SRC}.bin"
    size = path.stat().st_size
    sizes = _sizes(data / SRC)
    keep = int(sizes[:1500].sum()) * 2 + 3  # uint16 ids: 1,500 sentences and a byte and a half
    path.write_bytes(path.read_bytes()[:keep])
    _refused(data, tmp_path, rf"{re.escape(str(path))} has {keep:,} bytes where its index \(.*\.idx\) "
                             rf"needs {size:,}: the file is truncated from sentence 1,501 \(line 1,501 of "
                             r"the text fairseq-preprocess read\) on; re-run fairseq-preprocess")


def test_a_truncated_index_is_refused(data):
    path = data / f"{SRC}.idx"
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} has [\d,]+ bytes where its header's "
                                         r"2,000 sentences need [\d,]+: the index is truncated or damaged"):
        check_split(str(data / SRC))


def test_an_empty_training_set_is_refused_naming_the_file(data, tmp_path):
    for side in ("src", "tgt"):  # what fairseq-preprocess writes for empty text files
        prefix = data / f"train.src-tgt.{side}"
        MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16).finalize(f"{prefix}.idx")
    _refused(data, tmp_path, rf"{re.escape(str(data / SRC))}.bin is empty \(0 sentences in its index\): "
                             "the split has no tokens")


def test_a_dictionary_that_lost_lines_is_refused_naming_the_file_the_id_and_the_sentence(data, tmp_path):
    largest = int(np.fromfile(data / f"{SRC}.bin", dtype=np.uint16).max())
    for side in ("src", "tgt"):  # --share-all-embeddings: both dictionaries the same
        lines = (data / f"dict.{side}.txt").read_text().splitlines(keepends=True)
        # the lines from the source's largest id on lost (4 specials come before the file's words)
        (data / f"dict.{side}.txt").write_text("".join(lines[:largest - 4]))
    entries = len(Dictionary.load(str(data / "dict.src.txt")))
    assert entries == largest
    for split in ("valid", "train"):  # the order fairseq-train loads them in
        prefix = data / f"{split}.src-tgt.src"
        ids = np.fromfile(f"{prefix}.bin", dtype=np.uint16)
        if ids.max() >= entries:
            break
    sizes = _sizes(prefix)
    first = int(np.argmax(ids >= entries))
    sentence = int(np.searchsorted(np.cumsum(sizes), first, side="right")) + 1
    _refused(data, tmp_path, rf"{re.escape(str(prefix))}.bin: token id {int(ids[first])} in sentence "
                             rf"{sentence:,} \(line {sentence:,} of the text fairseq-preprocess read\) is "
                             rf"beyond the {entries} entries of {re.escape(str(data / 'dict.src.txt'))}: "
                             "the data was made with another dictionary")


def test_good_splits_pass_and_every_shard_of_a_combined_split_is_checked(data):
    dictionary = Dictionary.load(str(data / "dict.src.txt"))
    for split in ("train", "valid", "test"):
        check_split(str(data / f"{split}.src-tgt.src"))
        check_token_ids(str(data / f"{split}.src-tgt.src"), len(dictionary))
    for suffix in (".bin", ".idx"):  # a second shard (combine appends 1 to the path) with an id too many
        shutil.copy(data / f"{SRC}{suffix}", data / f"{SRC}1{suffix}")
    path = data / f"{SRC}1.bin"
    ids = np.fromfile(path, dtype=np.uint16)
    ids[0] = len(dictionary) + 5
    ids.tofile(path)
    assert len(data_utils.load_indexed_dataset(str(data / SRC), dictionary, "mmap")) == 2000
    with pytest.raises(ValueError, match=rf"{SRC}1.bin: token id {len(dictionary) + 5} in "
                                         r"sentence 1 \(line 1 of"):
        data_utils.load_indexed_dataset(str(data / SRC), dictionary, "mmap", combine=True)
