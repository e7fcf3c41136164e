"""What the tests and the benchmarks share (never imported by the package itself).

- ``cluster``: ``Cluster``, N real processes over gloo with megatron-core's groups;
  ``free_port``.
- ``collectives``: ``count_collectives``, a pass-through spy on torch.distributed.
- ``flight_sim``: flight records of a simulated cluster, written by the real recorder.
- ``gpu_work``: GPU work queued on the stream, to see what waits for it.
- ``tmp``: ``private_tmpdir``, a TMPDIR removed with what every process left in it.
- ``bench``: the parts of the benchmarks (scripts/bench_*.py are their command lines) and
  their one timing helper.
"""
