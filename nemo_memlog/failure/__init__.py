"""The failure path: what a rank leaves behind for ``nemo-memlog postmortem``.

- ``records``: the flight-record file format (versioned; no torch).
- ``recorder``: ``FlightRecorder``, the ring file one rank writes on the step path, and
  ``open_recorder``, which shares one recorder per folder within a process.
- ``identity``: who writes a file: the run id every rank agrees on, this rank's coordinates.
- ``evidence``: the host's side of an OOM kill (MemAvailable, RSS, OOM-kill counters).
- ``oom``: the CUDA allocator's OOM observer, writing an ``oom`` record and a snapshot.
- ``peers``: which peers have not reached a logging step, from their flight records (the stall notice).

Imports go one way: recorder -> oom, identity, evidence, records; none of those imports
recorder. Writing is the rank's, and it never raises into training. Of these, ``import nemo_memlog``
imports ``records`` only (reduce/channel.py words a lost peer as ``records.PEER_LOSS`` reads it); the
offline reader (``nemo_memlog.offline``) imports ``records`` only.
"""
