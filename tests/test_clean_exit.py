"""fairseq's batch-prefetch thread must not abort the process at exit (fairseq_fp16.patches.prefetch)."""

import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT, TINY_MODEL, TRAIN, USER_DIR, stock_abort_at_exit
from fairseq.data import iterators

from fairseq_fp16 import patches
from fairseq_fp16.patches import prefetch

BUSY_TRAIN = ROOT / "tests" / "busy_collate_train.py"


def _busy_train(data, save_dir, plugin):
    common = TRAIN if plugin else [{"translation_fp16": "translation", "fp16_adam": "adam"}.get(a, a)
                                   for a in TRAIN]
    args = [data, *TINY_MODEL, *common, "--save-dir", save_dir, "--max-update", "2",
            "--disable-validation", "--no-save"] + (["--user-dir", USER_DIR] if plugin else [])
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, str(BUSY_TRAIN), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300)


def test_training_that_ends_while_a_batch_is_collated_exits_cleanly(toy_data, tmp_path):
    proc = _busy_train(toy_data, tmp_path / "plugin", plugin=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "done training" in proc.stdout + proc.stderr
    assert "terminate called" not in proc.stderr


@pytest.mark.skipif(sys.version_info[:2] != (3, 11),
                    reason="the abort is Python 3.11's end of daemon threads at exit")
def test_stock_fairseq_aborts_there(toy_data, tmp_path):
    # The failure the plugin removes, shown with the same trigger: the test above can fail.
    proc = _busy_train(toy_data, tmp_path / "stock", plugin=False)
    assert "done training" in proc.stdout + proc.stderr
    assert proc.returncode == -6, proc.stderr[-2000:]
    assert "terminate called without an active exception" in proc.stderr
    assert stock_abort_at_exit(proc)  # what the tests needing only a stock checkpoint accept


def test_only_the_abort_after_done_training_is_accepted_from_stock_fairseq():
    done = "| INFO | fairseq_cli.train | done training in 0.4 seconds\n"
    abort = "terminate called without an active exception\nFatal Python error: Aborted\n"
    assert stock_abort_at_exit(subprocess.CompletedProcess([], -6, done, abort))
    assert not stock_abort_at_exit(subprocess.CompletedProcess([], -6, "", abort))  # before the end
    assert not stock_abort_at_exit(subprocess.CompletedProcess([], 1, done, abort))
    assert not stock_abort_at_exit(subprocess.CompletedProcess([], -6, done, "Fatal Python error: Aborted\n"))


def test_consumer_hands_over_every_batch_then_the_end():
    items = list(range(25))
    itr = iterators.BufferedIterator(3, items)
    assert list(itr) == items


def test_exit_handler_stops_a_consumer_blocked_on_a_full_queue():
    itr = iterators.BufferedIterator(2, list(range(100)))
    assert next(itr) == 0
    consumer = itr._consumer
    time.sleep(0.3)  # the queue fills, the consumer waits
    assert consumer.is_alive()
    try:
        start = time.monotonic()
        prefetch.stop_consumers(timeout=5)
        assert not consumer.is_alive()
        assert time.monotonic() - start < 1.0
    finally:
        prefetch._STOP.clear()  # in this process consumers must keep working


def test_install_refuses_a_consumer_it_does_not_know(monkeypatch):
    patches.uninstall()

    def run(self):
        pass

    monkeypatch.setattr(iterators.BackgroundConsumer, "run", run)
    try:
        with pytest.raises(RuntimeError, match=r"BackgroundConsumer\.run changed \('for item in self\._source:' "
                                               r"not found\)"):
            patches.install()
        assert not patches.is_installed()
    finally:
        monkeypatch.undo()
        patches.install()
    assert iterators.BackgroundConsumer.run is prefetch._run
