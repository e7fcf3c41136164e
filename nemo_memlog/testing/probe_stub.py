"""A stand-in for a training job under ``nemo-memlog fit``: one rank's per-layer record, written in
well under a second, as the tests of fit (tests/test_fit_hostile.py, tests/test_fit_guard.py) need.
"""

#: A probe in a few lines (``python -c STUB SIZE MODE``): one rank's record at the size it is
#: given (peak 5 GB + 0.1 GB per sample, 64 samples per iteration), rewritten at measured steps 2 to 8
#: (one peak: steady, however fit's probe polls), as MODE says: "ok"; "nofacts"
#: (no microbatches); "norank" and "steps-text" (a bad field); "oom-above-N" and "hang-above-N"
#: (above size N: an OOM, or no record); "keeps-microbatches" (32 microbatches at any size; above
#: size 2 one measured step, then a 600 s wait).
STUB = """
import json, os, sys, time
size, mode = int(sys.argv[1]), sys.argv[2]
if mode.startswith(("oom-above-", "hang-above-")) and size > int(mode.rsplit("-", 1)[1]):
    if mode.startswith("oom"):
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", flush=True)
        sys.exit(1)
    time.sleep(600)
facts = {} if mode == "nofacts" else {"microbatches": 32 if mode == "keeps-microbatches" else 64 // size}
figures = {"params_gb": 1.0, "grads_gb": 1.0, "optimizer_state_gb": 2.0}
layer = {"name": "l", "kind": "layer", "chunk": 0, "number": 0, **figures,
         "activations_per_microbatch_gb": 0.1 * size, "input_per_microbatch_gb": 0.01}
stage = {**figures, "model_state_gb": 4.0, "activations_gb": 0.1 * size, "activations_per_microbatch_gb": 0.1 * size,
         "microbatches_in_flight": 1, "chunks": 1, "peak_host_rss_gb": 5.0 + 0.1 * size, "host_total_gb": 64.0}
record = {"format": "nemo_memlog.layers", "version": 1, "rank": 0, "world_size": 1, "pp_rank": 0, "pp_size": 1,
          "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "iteration": 2, "time": time.time(),
          "measured_steps": 2, "run": {"micro_batch_size": size, **facts}, "stage": stage, "layers": [layer]}
if mode == "norank":
    del record["rank"]
slow = mode == "keeps-microbatches" and size != 2  # a later probe: its first measured step, then a long wait
path = os.path.join(os.environ["NEMO_MEMLOG_PROBE_DIR"], "rank-00000.layers.json")
for steps in [1] if slow else range(2, 9):  # steps 2..8, one peak: steady however fit's probe polls
    record["measured_steps"] = "two" if mode == "steps-text" else steps
    with open(path + ".tmp", "w") as file:
        json.dump(record, file)
    os.replace(path + ".tmp", path)
    time.sleep(0.1)
if slow:
    time.sleep(600)
"""
