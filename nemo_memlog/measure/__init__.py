"""The measurement add-ons: what the step path's numbers are made of, beyond the allocator's
statistics. Each is read by the run (monitor/__init__.py) on logging steps, and none runs a collective.

- ``composition``: model state, activations, temporaries and allocator slack, per stage;
- ``activations``: the activation meter (saved-tensor hooks, on logging iterations only);
- ``step``: a logging step's measurement assembled (activations, model state, breakdown, phases);
- ``layers``: a stage's layers and model chunks, found in the model;
- ``layer_rows``: each layer's row of the per-layer record, from the measurement;
- ``layer_record``: the per-layer record's file format beside the flight record (read by ``advise``);
- ``estimate``: a framework's own estimate, held against the measurement;
- ``phase``: named memory phases (``memory_phase``);
- ``host_idle``: on CPU, the process's idle size before a measured iteration's first microbatch.

The job's memory cgroup limit is ``host_limit``, a module of the package's root (beside rank/memory.py).
"""
