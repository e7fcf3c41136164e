"""The measurement add-ons: what the step path's numbers are made of, beyond the allocator's
statistics. Each is read by the run (monitor.py) on logging steps, and none runs a collective.

- ``composition``: model state, activations, temporaries and allocator slack, per stage;
- ``activations``: the activation meter (saved-tensor hooks, on logging iterations only);
- ``step``: a logging step's measurement assembled (activations, model state, breakdown, phases);
- ``layer_record``: the per-layer record beside the flight record (read by ``advise``);
- ``estimate``: a framework's own estimate, held against the measurement;
- ``phase``: named memory phases (``memory_phase``);
- ``host_limit``: the job's memory cgroup limit, followed each step.
"""
