"""What the tests and the benchmarks share (never imported by the package itself).

- ``cluster``: ``Cluster``, N real processes over gloo with megatron-core's groups;
  ``free_port``.
- ``collectives``: ``count_collectives``, a pass-through spy on torch.distributed.
- ``flight_sim``: flight records of a simulated cluster, written by the real recorder.
"""
