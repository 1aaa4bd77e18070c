"""The benchmarks (``fairseq_train``, ``half_matmul``, ``optimizer``), the wrapper that measures
a fairseq CLI run (``run_stats``: wall time, peak memory, the machine, a profile of chosen
updates) and the profile's summary (``profile_summary``)."""
