"""Megatron-LM's own loop on a real GPU (NCCL, a world of one, no stand-in) with
``megatron_lm.install()``: the four ``mem-*`` scalars nemo_memlog writes in Megatron-LM's place,
against this rank's ``torch.cuda.memory_stats()`` read apart right after each ``training_log``, and
the ``lm loss`` of the same run without nemo_memlog, bit for bit. The same through the front door
(``nemo-memlog run --`` before torchrun, no edit of the script), and with ``NEMO_MEMLOG_DISABLED=true``
under it: Megatron-LM's own ``mem-*`` and losses, as without us."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from nemo_memlog.testing import torchrun
from nemo_memlog.testing.megatron import lm_stand_ins as megatron_lm_stand_ins
from tests import readback

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not megatron_lm_stand_ins.has_loop(), reason="Megatron-LM's loop ships in megatron-core 0.17+"),
    pytest.mark.gpu,
    pytest.mark.processes,
]

FLAGS = (
    *("--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "512"),
    *("--max-position-embeddings", "512", "--micro-batch-size", "2", "--global-batch-size", "8"),
    *("--train-iters", "4", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "4095"),
    *(
        "--eval-interval",
        "100",
        "--eval-iters",
        "1",
        "--log-interval",
        "1",
        "--transformer-impl",
        "local",
        "--no-persist-layer-norm",
    ),
    *("--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion"),
    *("--no-bias-dropout-fusion", "--log-memory-to-tensorboard"),
)
MEM = {
    "mem-reserved-bytes": "reserved_bytes.all.current",
    "mem-allocated-bytes": "allocated_bytes.all.current",
    "mem-max-allocated-bytes": "allocated_bytes.all.peak",
    "mem-allocated-count": "allocation.all.current",
}


RUN = (sys.executable, "-m", "nemo_memlog.cli", "run", "--")
#: name -> (the launcher before torchrun, the job's flags, environment); "stats": the allocator read apart.
RUNS = {
    "alone": ((), (), {}),
    "ours": ((), ("--nemo-memlog", "stats"), {}),
    "run": (RUN, ("stats",), {}),
    "disabled": (RUN, (), {"NEMO_MEMLOG_DISABLED": "true"}),
}


def test_mem_series_are_the_allocators_own_and_losses_unchanged(tmp_path):
    runs = {}
    for name, (prefix, extra, env) in RUNS.items():
        flags = [flag for flag in extra if flag != "stats"]
        if "stats" in extra:
            flags += ["--device-stats", tmp_path / name / "stats"]
        done = torchrun.run(
            "-m",
            "nemo_memlog.testing.megatron.lm_job",
            *FLAGS,
            "--tensorboard-dir",
            tmp_path / name / "tb",
            *flags,
            nproc=1,
            timeout_s=400,
            prefix=prefix,
            env=env,
        )
        assert done.returncode == 0, torchrun.tail(done)
        runs[name] = readback.tensorboard_runs(tmp_path / name / "tb")
    alone = runs["alone"]["."]
    for name in ("ours", "run"):
        assert runs[name]["."]["lm loss"] == alone["lm loss"], name
        stats = json.loads((tmp_path / name / "stats" / "stats-0.json").read_text())
        for series, key in MEM.items():
            logged = runs[name]["."][series]
            assert [step for step, _ in logged] == [1, 2, 3, 4], (name, series)
            for step, value in logged:
                assert value == pytest.approx(stats[str(step)][key], rel=1e-6), (name, series, step)  # float32
    # Switched off where it is installed: Megatron-LM's own run, its own mem-* series, nothing of ours.
    disabled = runs["disabled"]
    assert list(disabled) == ["."] and set(disabled["."]) == set(alone), sorted(set(disabled["."]) ^ set(alone))
    for series in ("lm loss", *MEM):
        assert disabled["."][series] == alone[series], series
