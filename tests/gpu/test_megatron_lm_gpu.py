"""Megatron-LM's own loop on a real GPU (NCCL, a world of one, no stand-in) with
``megatron_lm.install()``: the four ``mem-*`` scalars nemo_memlog writes in Megatron-LM's place,
against this rank's ``torch.cuda.memory_stats()`` read apart right after each ``training_log``, and
the ``lm loss`` of the same run without nemo_memlog, bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from nemo_memlog.testing import megatron_lm_stand_ins, torchrun
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
    *("--eval-interval", "100", "--log-interval", "1", "--transformer-impl", "local", "--no-persist-layer-norm"),
    *("--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion"),
    *("--no-bias-dropout-fusion", "--log-memory-to-tensorboard"),
)
MEM = {
    "mem-reserved-bytes": "reserved_bytes.all.current",
    "mem-allocated-bytes": "allocated_bytes.all.current",
    "mem-max-allocated-bytes": "allocated_bytes.all.peak",
    "mem-allocated-count": "allocation.all.current",
}


def test_mem_series_are_the_allocators_own_and_losses_unchanged(tmp_path):
    runs = {}
    for name, extra in (("alone", ()), ("ours", ("--nemo-memlog", "--device-stats", tmp_path / "ours" / "stats"))):
        done = torchrun.run(
            "-m",
            "nemo_memlog.testing.megatron_lm_job",
            *FLAGS,
            "--tensorboard-dir",
            tmp_path / name / "tb",
            *extra,
            nproc=1,
            timeout_s=400,
        )
        assert done.returncode == 0, torchrun.tail(done)
        runs[name] = readback.tensorboard_runs(tmp_path / name / "tb")["."]
    assert runs["ours"]["lm loss"] == runs["alone"]["lm loss"]
    stats = json.loads((tmp_path / "ours" / "stats" / "stats-0.json").read_text())
    for name, key in MEM.items():
        logged = runs["ours"][name]
        assert [step for step, _ in logged] == [1, 2, 3, 4], name
        for step, value in logged:
            assert value == pytest.approx(stats[str(step)][key], rel=1e-6), (name, step)  # TensorBoard keeps float32
