"""The comparison and benchmark tools behind ``scripts/``: each script is a command line over
one module here.

Importing this package imports neither fairseq nor the plugin (``import fairseq_fp16`` installs
its patches into fairseq): the modules that read results (``runs``, ``stats``, ``summary``,
``tables``, ``plots``, ``report``, ``verdict``, ``render_docs``, ``bench.profile_summary``) never
do, and those that train, decode or load checkpoints run fairseq in subprocesses or import it
where they need it. Imports flow one way: scripts -> fairseq_fp16_tools -> fairseq_fp16.
"""
