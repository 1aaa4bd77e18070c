"""Wall time of a call in one process: the micro-benchmarks' one timer."""

import statistics
import time
from typing import Callable


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """The median wall time of ``fn()`` over ``repeats`` calls, in ms, after ``warmup`` untimed
    calls (a compile, the allocator's first blocks)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000.0
