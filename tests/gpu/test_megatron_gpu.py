"""megatron-core's own GPTModel, DDP, optimizer and schedule on a real GPU, with no stand-in
(skipped without CUDA or megatron-core): the measured activations against every saved tensor
counted around the schedule; the measured parts against the allocator's own peak; and ``advise``'s
``micro_batch_size=x2`` against a rerun, on the allocator's peak. Each run in a fresh process, in
an NCCL world of one (PP 1)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.gpu,
    pytest.mark.processes,
]

SPEC = dict(pp=1, layers=4, hidden=1024, heads=16, seq=1024, vocab=8192, micro_batch_size=2, microbatches=2)


def _run(spec, root):
    from nemo_memlog.testing.megatron import cpu as megatron_cpu

    return megatron_cpu.logged_run(spec, root)


def _spec(**changes):
    from nemo_memlog.testing.megatron.cpu import JobSpec

    return dataclasses.replace(JobSpec(**SPEC, device="cuda"), **changes)


def test_megatron_on_cuda_activations_parts_and_advice_against_the_allocator(tmp_path):
    from nemo_memlog import advice
    from nemo_memlog.offline import advise
    from tests.gpu.fresh import run_alone

    base = run_alone(_run, _spec(), str(tmp_path / "base"), backend="nccl", timeout=600)
    stage = base["layers"]["stage"]
    # activations against the count made apart
    assert stage["activations_gb"] == pytest.approx(base["saved_peak_bytes"] / 1e9, rel=0.01)
    # model state to the byte against Megatron's buffers and Adam's rule
    for part in ("params", "grads", "optimizer_state"):
        assert round(stage[f"{part}_gb"] * 1e9) == base["apart"][part]
    # the measured parts fit under the allocator's own peak, with what is left (temporaries) small
    # beside the activations: the allocator's number is made apart from ours
    unexplained = stage["peak_allocated_gb"] - stage["model_state_gb"] - stage["activations_gb"]
    assert 0 <= unexplained < stage["activations_gb"], stage
    # advise against a rerun, on the allocator's peak
    run = advise.load(tmp_path / "base" / "memory_records")
    (outcome,) = advice.predict(run, advice.parse(["micro_batch_size=x2"]))
    rerun = run_alone(_run, _spec(micro_batch_size=4, microbatches=1), str(tmp_path / "x2"), backend="nccl")
    after = rerun["layers"]["stage"]
    assert outcome.predicted["activations_gb"] == pytest.approx(after["activations_gb"], rel=0.02)
    predicted_allocated = sum(outcome.predicted[p] for p in ("model_state_gb", "activations_gb", "temporaries_gb"))
    assert predicted_allocated == pytest.approx(after["peak_allocated_gb"], rel=0.10)
