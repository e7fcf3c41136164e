"""What the tests and the benchmarks share (never imported by the package itself).

- ``cluster``: ``Cluster``, N real processes over gloo with megatron-core's groups;
  ``free_port``.
- ``rank_preload``: what every ``Cluster`` rank imports, once, in the forkserver that forks them.
- ``megatron/``: Megatron on CPU: megatron-core's own training stack (``cpu``, ``stand_ins``, ``job``:
  GPTModel, DDP, optimizer, schedule; a training job as a command line, ``nemo-memlog fit``'s tests)
  and Megatron-LM's own loop (``lm_stand_ins``, ``lm_job``: a pretraining script of our own).
- ``bridge_env``: Megatron-Bridge on a CPU-only machine (what stands in for its GPU and Python).
- ``bridge_harness``: Megatron-Bridge's training loop, driven on CPU gloo ranks, with its real pieces.
- ``bridge_megatron``: Bridge's own ``train_step`` over a real megatron-core job.
- ``bridge_probes``: Bridge's MLflow spelling, the loggers it opens, the callback's off-interval cost.
- ``cgroups``: real memory cgroups with a limit (``memory_cgroup``).
- ``probe_stub``: a stand-in job under ``nemo-memlog fit``: one rank's per-layer record, at once.
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

The benchmarks' parts and their one timing helper are not here: they are scripts/bench/ (not installed).
"""
