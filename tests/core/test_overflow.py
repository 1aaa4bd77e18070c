"""The overflow record: its counts, the stop decision and the checkpoint round trip."""

import pytest

from fairseq_fp16.core.overflow import OverflowRecord, stop_cause


def test_the_record_counts_overflows_and_stops_at_the_limit():
    record = OverflowRecord()
    record.overflowed()
    assert (record.skipped, record.pending) == (1, True)
    assert [record.count(3) for _ in range(3)] == [False, False, True]
    record.next_update()
    record.finite()
    assert (record.skipped, record.consecutive, record.pending) == (1, 0, False)
    error = FloatingPointError("cannot heal")
    assert record.stop(error) is error and record.stop_error is error


def test_the_counts_survive_a_checkpoint_and_an_older_one_reads_as_none():
    record = OverflowRecord(skipped=7, consecutive=2, pending=True)
    again = OverflowRecord()
    again.load_state_dict(record.state_dict())
    assert (again.skipped, again.consecutive, again.pending) == (7, 2, False)
    again.load_state_dict({"optimizer": {}})  # a checkpoint from before the counts were kept
    assert (again.skipped, again.consecutive) == (0, 0)


@pytest.mark.parametrize("findings,advice", [
    (dict(first_nonfinite={"kind": "inf", "module": "decoder.layers.0.fc1", "type": "Linear",
                           "dtype": "torch.float16"}),
     r"first inf in the output of decoder\.layers\.0\.fc1 .*--fp32-modules 'decoder\\\.layers\\\.0\\\.fc1'"),
    (dict(loss_finite=False), "the loss is not: check the criterion and the batch"),
    (dict(culprits=[]), "every gradient is finite .* clip with --clip-norm"),
    (dict(culprits=[{"param": "fc.weight"}], static_fp16_scale=65536.0),
     r"static loss scale 65536, .* \(in: fc\.weight\); lower --loss-scale"),
    (dict(culprits=[{"param": "fc.weight"}]), r"gradients overflow in: fc\.weight; lower --lr"),
])
def test_the_cause_names_what_to_change(findings, advice):
    with pytest.raises(FloatingPointError, match=advice):
        raise FloatingPointError(stop_cause(**findings))
