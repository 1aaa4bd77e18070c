"""Stop fairseq's batch-prefetch threads before the interpreter exits.

fairseq's ``BufferedIterator`` collates the next batches in a daemon thread
(``fairseq.data.iterators.BackgroundConsumer``). If ``fairseq-train`` or
``fairseq-generate`` ends while that thread is inside a torch call, Python
3.11 ends the thread as it takes the GIL back, in the middle of torch's C++
frames, and the process aborts after its work is done: ``terminate called
without an active exception``, exit status -6 (SIGABRT), after ``done
training``. Whether it happens depends on timing, so it strikes now and then
(stock fairseq too), and a script that checks the exit status sees a failed
run whose checkpoints are fine.

The patch replaces ``BackgroundConsumer.run`` with one that puts into
the queue with a short timeout and returns once :data:`_STOP` is set, and
registers an ``atexit`` handler that sets it and joins the running consumers.
``atexit`` handlers run before the interpreter starts tearing daemon threads
down, so the consumers end with the interpreter intact. Batches are produced
and handed over exactly as before.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref

import torch
from fairseq.data import iterators

from .registry import Patch

__all__ = ["PATCHES", "stop_consumers"]

RUN = "fairseq.data.iterators:BackgroundConsumer.run"
#: How long the exit handler waits for a consumer to finish the batch it is collating.
JOIN_TIMEOUT_S = 30.0
#: How often a consumer blocked on a full queue looks at :data:`_STOP`.
_POLL_S = 0.05

_STOP = threading.Event()
_CONSUMERS: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()


def _put(q: queue.Queue, item) -> bool:
    """Put ``item`` into ``q``, waiting while it is full; False once stopping."""
    while not _STOP.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _run(self) -> None:
    _CONSUMERS.add(self)
    if self.cuda_device is not None:  # as fairseq: no stray context on GPU 0
        torch.cuda.set_device(self.cuda_device)
    try:
        for item in self._source:
            if not _put(self._queue, item):
                return
            self.count += 1
            if self._max_len is not None and self.count >= self._max_len:
                break
        _put(self._queue, iterators._sentinel)
    except Exception as e:  # handed to the training loop, which raises it (as fairseq)
        _put(self._queue, e)


def stop_consumers(timeout: float = JOIN_TIMEOUT_S) -> None:
    """Make every running consumer return and wait for it (the exit handler)."""
    _STOP.set()
    for thread in list(_CONSUMERS):
        if thread is not threading.current_thread():
            thread.join(timeout)


def _register_exit_handler() -> None:
    atexit.register(stop_consumers)


def _unregister_exit_handler() -> None:
    atexit.unregister(stop_consumers)


PATCHES = [
    Patch(RUN, group="repair", replacement=_run,
          expects=["for item in self._source:", "self._queue.put(item)", "self._queue.put(_sentinel)",
                   "self._queue.put(e)", "self.count >= self._max_len"],
          on_install=_register_exit_handler, on_uninstall=_unregister_exit_handler,
          why="fairseq's batch-prefetch thread can be ended by the exiting interpreter inside "
              "torch's C++ code (SIGABRT after 'done training'); the replacement returns once "
              "an atexit handler asks it to, before the interpreter tears threads down"),
    Patch("fairseq.data.iterators:_sentinel", group="repair",
          condition=lambda sentinel: None if type(sentinel) is object else f"it is a {type(sentinel).__name__}",
          why="relied on: the end-of-data marker the replacement puts into the queue"),
]
