"""swap_attribute: one object's attribute replaced after the source check, and put back."""

import pytest

from fairseq_fp16.core.swap import swap_attribute


class Dataset:
    def collater(self, samples, pad_to_length=None):
        return ("own", samples, pad_to_length)


def test_a_swap_changes_one_object_and_its_undo_puts_back_what_it_had():
    swapped, other = Dataset(), Dataset()
    undo = swap_attribute(swapped, "collater", lambda samples, pad_to_length=None: "bucketed",
                          expects=["pad_to_length"])
    assert swapped.collater([1]) == "bucketed" and other.collater([1]) == ("own", [1], None)
    undo()
    assert "collater" not in vars(swapped) and swapped.collater([1]) == ("own", [1], None)

    own = swapped.collater = lambda samples, pad_to_length=None: "its own"
    undo = swap_attribute(swapped, "collater", lambda samples, pad_to_length=None: "bucketed")
    undo()
    assert swapped.collater is own


def test_an_undo_leaves_a_later_swap_in_place():
    dataset = Dataset()
    first = swap_attribute(dataset, "collater", lambda *a: "first")
    swap_attribute(dataset, "collater", lambda *a: "second")
    first()
    assert dataset.collater() == "second"


def test_a_class_whose_source_lacks_what_the_swap_relies_on_is_refused():
    class Older:
        def collater(self, samples):
            return samples

    with pytest.raises(RuntimeError, match=r"test_swap:.*Older\.collater changed \('pad_to_length' not found\)"):
        swap_attribute(Older(), "collater", lambda *a: None, expects=["pad_to_length"])
    with pytest.raises(RuntimeError, match=r"Older\.batch_by_size does not exist"):
        swap_attribute(Older(), "batch_by_size", lambda *a: None)
