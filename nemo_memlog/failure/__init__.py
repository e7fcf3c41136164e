"""The failure path: what a rank leaves behind for ``nemo-memlog postmortem``.

- ``records``: the flight-record file format (versioned; no torch).
- ``recorder``: ``FlightRecorder``, the ring file one rank writes on the step path.
- ``oom``: the CUDA allocator's OOM observer, writing an ``oom`` record and a snapshot.

Writing is the rank's, and it never raises into training. Nothing here is imported by
``import nemo_memlog``; the offline reader (``nemo_memlog.offline``) imports ``records`` only.
"""
