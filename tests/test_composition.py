"""What the memory is made of (measure/composition.py): exact bytes for test models whose sizes and dtypes
give the answer, each storage counted once; then per stage over real gloo ranks (PP 4, each stage
a different size), through training_log, read back from TensorBoard."""

import math
import warnings

import pytest
import torch

from nemo_memlog import report_model_state
from nemo_memlog.measure.composition import ModelState, breakdown

GB = 1e9


def mlp(width: int, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)).to(dtype)


def numel(width: int) -> int:
    return width * 2 * width + 2 * width + 2 * width * width + width


def step(model, optimizer, dtype=torch.float32):
    loss = model(torch.ones(3, model[0].in_features, dtype=dtype)).float().sum()
    loss.backward()
    optimizer.step()


def test_sgd_with_momentum_params_grads_and_one_buffer_per_param():
    model = mlp(16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = report_model_state(model, optimizer)
    assert before == {
        "params_gb": numel(16) * 4 / GB,
        "grads_gb": 0.0,
        "optimizer_state_gb": 0.0,
        "model_state_gb": numel(16) * 4 / GB,
    }
    step(model, optimizer)
    after = report_model_state(model, optimizer)
    assert after["grads_gb"] == after["optimizer_state_gb"] == after["params_gb"] == numel(16) * 4 / GB
    assert after["model_state_gb"] == pytest.approx(3 * numel(16) * 4 / GB)


def test_adam_two_moments_and_a_step_tensor_per_param():
    model = mlp(8)
    optimizer = torch.optim.Adam(model.parameters())
    step(model, optimizer)
    state = report_model_state(model, optimizer)
    steps = 4 * 4  # one float32 "step" tensor per parameter tensor (4 of them)
    assert state["optimizer_state_gb"] == (2 * numel(8) * 4 + steps) / GB


def test_adam_over_fp32_master_copies_of_bf16_params():
    model = mlp(8, torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    optimizer = torch.optim.Adam(masters)
    model(torch.ones(3, 8, dtype=torch.bfloat16)).float().sum().backward()
    for master, param in zip(masters, model.parameters()):
        master.grad = param.grad.float()
    optimizer.step()
    state = report_model_state(model, optimizer)
    n = numel(8)
    assert state["params_gb"] == 2 * n / GB  # bf16
    assert state["grads_gb"] == (2 * n + 4 * n) / GB  # the bf16 grads and the masters' fp32 grads
    assert state["optimizer_state_gb"] == (4 * n + 2 * 4 * n + 4 * 4) / GB  # masters, two moments, steps


def test_grads_as_views_into_one_flat_buffer_are_counted_once_at_its_whole_size():
    model = mlp(8)
    padded = numel(8) + 13  # a bucket's padding is memory held
    flat = torch.zeros(padded)
    offset = 0
    for param in model.parameters():
        view = flat[offset : offset + param.numel()].view_as(param)
        param.main_grad = view  # Megatron's DDP: main_grad a view into the grad buffer
        param.grad = view  # and .grad pointing into the same buffer
        offset += param.numel()
    state = report_model_state([model], None)  # a list of chunks, as Megatron passes it
    assert state["grads_gb"] == padded * 4 / GB


def test_the_count_is_cached_until_the_optimizer_creates_its_state():
    model = mlp(8)
    optimizer = torch.optim.Adam(model.parameters())
    cache = ModelState()
    first = cache.report(model, optimizer)
    assert first["optimizer_state_gb"] == 0.0 and cache.report(model, optimizer) == first
    step(model, optimizer)
    assert cache.report(model, optimizer)["optimizer_state_gb"] > 0  # state appeared: recounted


def test_breakdown_adds_up_to_the_peak_reserved_on_a_gpu_and_is_nan_without_one():
    from nemo_memlog.measure.activations import Measurement

    state = {"params_gb": 6.1, "grads_gb": 6.1, "optimizer_state_gb": 18.3, "model_state_gb": 30.5}
    measured = Measurement(40.0, 4, 10.0, 8, (), (), (), {})
    gpu = breakdown({"peak_allocated_gb": 74.5, "peak_reserved_gb": 77.6}, state, measured)
    assert gpu["activations_gb"] == 40.0 and gpu["microbatches_in_flight"] == 4
    assert gpu["temporaries_gb"] == pytest.approx(4.0) and gpu["allocator_slack_gb"] == pytest.approx(3.1)
    parts = ("model_state_gb", "activations_gb", "temporaries_gb", "allocator_slack_gb")
    assert sum(gpu[part] for part in parts) == pytest.approx(77.6)
    cpu = breakdown({"peak_allocated_gb": math.nan, "host_rss_gb": 1.0}, state, measured)
    assert cpu["activations_gb"] == 40.0  # measured on every device
    assert math.isnan(cpu["temporaries_gb"]) and math.isnan(cpu["allocator_slack_gb"])
    unmeasured = breakdown({"peak_allocated_gb": 74.5, "peak_reserved_gb": 77.6}, state)
    assert math.isnan(unmeasured["activations_gb"]) and math.isnan(unmeasured["temporaries_gb"])


# ---- per stage, through training_log --------------------------------------------------------


def log_stage_models(tensorboard_dir):
    """Stage s holds an MLP of width 8 * (s + 1) with Adam; two steps, logging at 2."""
    from megatron.core import parallel_state as ps

    from nemo_memlog import LoggerConfig, close_writers, training_log

    stage = ps.get_pipeline_model_parallel_rank()
    model = mlp(8 * (stage + 1))
    optimizer = torch.optim.Adam(model.parameters())
    cfg = LoggerConfig(
        log_memory_to_tensorboard=True,
        tensorboard_log_interval=2,
        tensorboard_dir=tensorboard_dir,
        memory_record_dir="off",
    )
    logged = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for iteration in (1, 2):
            step(model, optimizer)
            logged = training_log(iteration, cfg, model=model, optimizer=optimizer) or logged
        close_writers()
    return logged


@pytest.mark.processes
def test_every_stage_its_own_breakdown_the_max_and_its_stage(pp4, tmp_path):
    results = pp4.run_ok(log_stage_models, str(tmp_path / "tb"))
    logged = results[0]
    assert all(r == logged for r in results[1:])
    expected = [(2 * 4 * numel(8 * (s + 1)) + 16) / GB for s in range(4)]  # two moments, four step tensors
    for s in range(4):
        assert logged[f"memory/pp_stage_{s}/optimizer_state_gb"] == pytest.approx(expected[s], rel=1e-12)
        assert logged[f"memory/pp_stage_{s}/params_gb"] == numel(8 * (s + 1)) * 4 / GB
    assert logged["memory/optimizer_state_gb"] == pytest.approx(expected[3], rel=1e-12)
    assert logged["memory/peak_stage/model_state_gb"] == 3
    assert "memory/temporaries_gb" not in logged  # NaN on every CPU stage: no allocator peak

    from nemo_memlog.offline.events import load_run

    run = load_run(tmp_path / "tb")
    written = run.per_stage("model_state_gb")
    assert [written[s].values[0] for s in range(4)] == pytest.approx(
        [logged[f"memory/pp_stage_{s}/model_state_gb"] for s in range(4)], rel=1e-6
    )


def test_the_estimate_and_its_gap_on_stage_0():
    from nemo_memlog.attribution import GatheredMemory, line_up, stage_figures, stage_value
    from nemo_memlog.measure.estimate import ESTIMATED_STAGE, PARTS, derived
    from nemo_memlog.payload import RankReport

    keys = ("activations_gb", "model_state_gb")
    values = [[8.0, 30.5], [6.0, 20.0], [4.0, 20.0], [2.0, 21.0]]
    gathered = line_up(keys, [RankReport(key_count=2, fingerprint=0, iteration=1, values=v) for v in values])
    measured = stage_figures(gathered, ESTIMATED_STAGE, PARTS)
    assert measured == {"activations_gb": 8.0, "model_state_gb": 30.5}  # stage 0's own, not the max
    out = derived({"model_state_gb": 28.0, "activations_gb": 9.5}, measured)
    assert out["memory/estimate/model_state_gb"] == 28.0 and out["memory/estimate/gap/model_state_gb"] == 2.5
    assert out["memory/estimate/gap/activations_gb"] == -1.5
    assert derived(None, {}) == {}
    # The world scope: positions are global ranks, stage_of[r] the stage of position r (gathered at
    # placement); stage 0 is the max over its ranks (here ranks 0 and 2).
    world = GatheredMemory(("activations_gb",), [[8.0], [5.0], [9.0], [3.0]])
    stage_of = [0, 1, 0, 1]
    assert stage_value(world, 0, "activations_gb", stage_of=stage_of) == 9.0
    assert stage_value(world, 1, "activations_gb", stage_of=stage_of) == 5.0
    assert stage_value(world, 0, "model_state_gb", stage_of=stage_of) is None


MEGATRON_DDP = """
import json, os, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from nemo_memlog import report_model_state
ps.initialize_model_parallel()
cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True)
model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=32)
current = torch.cuda.current_device
torch.cuda.current_device = lambda: "cpu"  # DDP allocates its buffers there: the CPU, here
try:
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
finally:
    torch.cuda.current_device = current
params = list(model.parameters())
print(json.dumps({
    "state": report_model_state([ddp]),
    "param_bytes": sum(p.numel() * p.element_size() for p in params),
    "grad_buffer_bytes": sum(b.grad_data.untyped_storage().nbytes() for b in ddp.buffers),
    "views": all(p.main_grad.untyped_storage().data_ptr() in
                 {b.grad_data.untyped_storage().data_ptr() for b in ddp.buffers} for p in params),
}))
"""


@pytest.mark.processes
def test_megatrons_real_ddp_grad_buffer_is_the_gradients_counted_once():
    """megatron-core 0.19's DistributedDataParallel over a GPTModel, built on CPU: every
    param.main_grad is a view into its grad buffer, which is counted once at its whole size."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from nemo_memlog.testing.cluster import free_port

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", MEGATRON_DDP, str(free_port())], capture_output=True, text=True, timeout=180, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["views"]
    assert seen["state"]["params_gb"] == seen["param_bytes"] / GB
    assert seen["state"]["grads_gb"] == seen["grad_buffer_bytes"] / GB


class _Wrapper(torch.Tensor):
    """A wrapper tensor subclass (as FP8's Float8Tensor is one): its storage has no data pointer."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=data.device)

    def __init__(self, data):
        self.inner = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map

        unwrapped = func(*tree_map(lambda t: t.inner if isinstance(t, _Wrapper) else t, args), **(kwargs or {}))
        return tree_map(lambda t: _Wrapper(t) if type(t) is torch.Tensor else t, unwrapped)


def test_a_wrapper_tensor_parameter_is_counted_at_its_size_not_raised_into_training():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    model[0].weight = torch.nn.Parameter(_Wrapper(torch.randn(32, 64)), requires_grad=False)
    with pytest.raises(RuntimeError):  # what the count read before: a storage without data
        model[0].weight.untyped_storage().data_ptr()
    state = report_model_state(model, None)
    expected = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9  # counted apart
    assert state["params_gb"] == pytest.approx(expected, rel=1e-12)
    assert ModelState().report(model, None)["params_gb"] == pytest.approx(expected, rel=1e-12)
