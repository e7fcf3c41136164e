"""What the tests and the benchmarks share (never imported by the package itself).

- ``cluster``: ``Cluster``, N real processes over gloo with megatron-core's groups;
  ``free_port``.
- ``collectives``: ``count_collectives``, a pass-through spy on torch.distributed.
- ``flight_sim``: flight records of a simulated cluster, written by the real recorder.
- ``gpu_work``: GPU work queued on the stream, to see what waits for it.
- ``tmp``: ``private_tmpdir``, a TMPDIR removed with what every process left in it.
- ``torchrun``: torchrun for real, one way for every test: ``run_ranks`` (run, read each rank's
  ``rank-<r>.json``), ``run``, ``start`` and ``kill_group`` (for a job signalled while it runs).
- ``wait``: ``wait_for``, a condition awaited with a deadline instead of a sleep (``seconds_until``
  says how long it took; ``returns_within``, a call that must return by a deadline; ``Lines``, a
  child's output read by a thread, for a wait); ``alive``.
- ``notices``: ``said``, what nemo_memlog said (its notices and warnings) within a block.
- ``mounts``: ``mounted`` and ``read_only``, folders mounted for a test (a full disk, a read-only one).
- ``bench``: the parts of the benchmarks (scripts/bench_*.py are their command lines) and
  their one timing helper.
"""
