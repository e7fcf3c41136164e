"""The benchmarks' parts, importable; scripts/bench_*.py are their command lines.

- ``timing``: the one timing helper (interleaved variants, tight loops, summaries, ratios'
  inputs), shared by every part;
- ``anchors``: the field's reductions and statistics reads, as their projects write them;
- ``stand_ins``: the H100's statistics fed through the real code, backends that write nothing,
  the exchange switch;
- one module per part of ``make bench``: ``pp_group`` (parts 1 and 2: one PP group of gloo
  processes; training_log off the logging steps), ``writer`` (3: the writer rank with real
  backends), ``host_memory`` (4: the writer rank's RSS), ``cuda`` (5: the allocator statistics,
  and the GPU part), ``flight_recorder`` (6: the recorder on and off), ``composition`` (8: the
  model state), ``activations`` (9: the activation meter on a logging iteration, and after it).
"""
