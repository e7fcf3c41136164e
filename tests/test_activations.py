"""Retained activations, measured (measure/activations.py), against a count made apart from the product:
the test walks autograd's graph of one microbatch and sums the storages its nodes saved
(``grad_fn._saved_*``), parameters left out. Then per stage over real gloo ranks (PP 2 x DP 2),
where stage s holds PP - s microbatches at once, through training_log, read back from TensorBoard
and the per-layer record; under torch.utils.checkpoint; with two model chunks per stage."""

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from nemo_memlog.measure.activations import ActivationMeter, find_layers
from tests.models import BATCH, WIDTH, blocks

GB = 1e9


class Checkpointed(nn.Module):
    """Each block under torch.utils.checkpoint (non-reentrant): only the blocks' inputs are kept."""

    def __init__(self, count: int, reentrant: bool = False):
        super().__init__()
        self.layers = blocks(count)
        self.reentrant = reentrant

    def forward(self, x):
        if self.reentrant:  # reentrant checkpoint needs an input that requires grad, as a stage's received one does
            x = x.detach().requires_grad_()
        for block in self.layers:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return x


def saved_bytes(output: torch.Tensor, model) -> int:
    """The independent count: every storage autograd's graph of ``output`` saved, once, parameters out."""
    params = {
        p.untyped_storage().data_ptr() for m in (model if isinstance(model, list) else [model]) for p in m.parameters()
    }
    seen, total, stack, visited = set(), 0, [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                for tensor in value if isinstance(value, tuple) else (value,):
                    if isinstance(tensor, torch.Tensor):
                        key = tensor.untyped_storage().data_ptr()
                        if key not in seen and key not in params:
                            seen.add(key)
                            total += tensor.untyped_storage().nbytes()
        stack += [child for child, _ in node.next_functions]
    return total


def microbatch(index: int) -> torch.Tensor:
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(index))


def one_f_one_b(chunks: list, held: int, count: int = 4) -> None:
    """``count`` microbatches, each through every chunk in turn, with at most ``held`` waiting for backward."""
    pending = []
    for index in range(count):
        x = microbatch(index)
        for chunk in chunks:
            x = chunk(x)
        pending.append(x.square().mean())
        if len(pending) == held:
            pending.pop(0).backward()
    for loss in pending:
        loss.backward()


# ---- one process: the meter against the graph walk ------------------------------------------


def test_held_at_once_per_microbatch_and_in_flight_match_the_graph_walk():
    model = blocks(3)
    reference = saved_bytes(model(microbatch(0)), model)
    meter = ActivationMeter()
    meter.arm(model)
    one_f_one_b([model], held=3, count=5)
    seen = meter.finish()
    assert seen.microbatches == 5 and seen.microbatches_in_flight == 3
    assert round(seen.activations_per_microbatch_gb * GB) == reference
    assert round(seen.activations_gb * GB) == 3 * reference
    # per layer: the blocks' own bytes add up to the microbatch's, their inputs are (BATCH, WIDTH) float32
    assert [layer.name for layer in seen.layers] == ["0", "1", "2", "other"]
    assert sum(seen.layer_activations_gb) * GB == pytest.approx(reference)
    assert [round(v * GB) for v in seen.layer_inputs_gb[:3]] == [BATCH * WIDTH * 4] * 3


def test_nothing_stays_installed_after_finish_and_an_unarmed_iteration_is_not_seen():
    model = blocks(2)
    meter = ActivationMeter()
    meter.arm(model)
    one_f_one_b([model], held=1, count=1)
    assert meter.finish() is not None
    hooks = [m._forward_hooks or m._forward_pre_hooks for m in model.modules()]
    assert not any(hooks)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert meter.finish() is None  # not armed: nothing measured


@pytest.mark.parametrize("reentrant", [False, True])
def test_under_checkpoint_only_each_blocks_input_is_held(reentrant):
    model = Checkpointed(3, reentrant)
    meter = ActivationMeter()
    meter.arm(model)
    one_f_one_b([model], held=2, count=3)
    seen = meter.finish()
    # independent: checkpoint keeps each block's input, a (BATCH, WIDTH) float32 tensor, and nothing else
    assert round(seen.activations_per_microbatch_gb * GB) == 3 * BATCH * WIDTH * 4
    assert seen.microbatches_in_flight == 2 and round(seen.activations_gb * GB) == 2 * 3 * BATCH * WIDTH * 4
    plain = blocks(3)
    assert saved_bytes(plain(microbatch(0)), plain) > 10 * 3 * BATCH * WIDTH * 4  # what recompute saved


def test_a_users_own_hooks_outside_the_forward_still_pack_and_unpack():
    model = blocks(2)
    packed, unpacked = [], []

    def pack(tensor):
        packed.append(tensor.shape)
        return tensor

    def unpack(tensor):
        unpacked.append(tensor.shape)
        return tensor

    meter = ActivationMeter()
    meter.arm(model)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = model(microbatch(0)).square().mean()
    loss.backward()
    seen = meter.finish()
    same = blocks(2)  # the same weights, unhooked
    inner = saved_bytes(same(microbatch(0)), same)
    assert round(seen.activations_per_microbatch_gb * GB) == inner
    assert len(packed) > 10 and len(unpacked) >= len(packed) - 2  # theirs saw every saved tensor too
    reference = torch.autograd.grad(same(microbatch(0)).square().mean(), list(same.parameters()))
    assert all(torch.allclose(p.grad, r) for p, r in zip(model.parameters(), reference))


def test_two_chunks_count_a_chunks_forward_as_a_microbatch():
    chunks = [blocks(2, seed=1), blocks(1, seed=2)]
    per_chunk = [saved_bytes(chunks[0](microbatch(0)), chunks[0]), saved_bytes(chunks[1](microbatch(0)), chunks[1])]
    meter = ActivationMeter()
    meter.arm(chunks)
    one_f_one_b(chunks, held=2, count=4)
    seen = meter.finish()
    assert seen.microbatches == 8 and seen.microbatches_in_flight == 4  # 2 microbatches x 2 chunks
    assert round(seen.activations_per_microbatch_gb * GB) == pytest.approx(sum(per_chunk) / 2)
    assert round(seen.activations_gb * GB) == 2 * sum(per_chunk)
    assert [(layer.chunk, layer.name) for layer in seen.layers] == [(0, "0"), (0, "1"), (1, "0"), (-1, "other")]


def test_megatrons_layers_embedding_and_output_layer():
    from megatron.core.transformer.module import MegatronModule  # noqa: F401 -- megatron-core is installed

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
            self.final_layernorm = nn.LayerNorm(4)

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding, self.decoder, self.output_layer = nn.Embedding(8, 4), Decoder(), nn.Linear(4, 8)

    class Wrapper(nn.Module):  # DDP / Float16Module: the model under .module
        def __init__(self):
            super().__init__()
            self.module = GPT()

    found = find_layers([Wrapper()])
    assert [(layer.kind, layer.name) for layer in found] == [
        ("embedding", "embedding"),
        *[("layer", f"decoder.layers.{i}") for i in range(3)],
        ("output", "output_layer"),
        ("other", "other"),
    ]


# ---- per stage, over gloo ranks, through training_log ----------------------------------------


def stage_job(tensorboard_dir, record_dir, mode):
    """Stage s runs 4 microbatches holding PP - s at once; logs at iteration 2 (armed by the call at 1)."""
    from megatron.core import parallel_state as ps

    from nemo_memlog import LoggerConfig, close_writers, training_log

    stage, stages = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    if mode == "chunks":
        model = [blocks(1 + stage, seed=stage), blocks(1, seed=10 + stage)]
    elif mode == "checkpoint":
        model = Checkpointed(2 + stage)
    else:
        model = blocks(2 + stage, seed=stage)
    chunks = model if isinstance(model, list) else [model]
    if mode == "checkpoint":
        per_microbatch = [(2 + stage) * BATCH * WIDTH * 4]  # each block's input, nothing else
    else:
        per_microbatch = [saved_bytes(chunk(microbatch(0)), chunk) for chunk in chunks]
    optimizer = torch.optim.Adam([p for chunk in chunks for p in chunk.parameters()])
    cfg = LoggerConfig(
        log_memory_to_tensorboard=True,
        tensorboard_log_interval=2,
        tensorboard_dir=tensorboard_dir,
        memory_record_dir=record_dir,
    )
    logged = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for iteration in (1, 2):
            one_f_one_b(chunks, held=stages - stage)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)  # before the call: the gradients must still count
            logged = training_log(iteration, cfg, model=model, optimizer=optimizer) or logged
        close_writers()
    param_bytes = sum(p.numel() * 4 for chunk in chunks for p in chunk.parameters())
    return {"logged": logged, "per_microbatch": per_microbatch, "param_bytes": param_bytes, "stage": stage}


@pytest.mark.processes
@pytest.mark.parametrize("mode", ["plain", "checkpoint", "chunks"])
def test_every_stage_its_activations_in_flight_and_per_microbatch(pp2dp2, tmp_path, mode):
    results = pp2dp2.run_ok(stage_job, str(tmp_path / "tb"), str(tmp_path / "records"), mode)
    logged = results[-1]["logged"]
    chunks = 2 if mode == "chunks" else 1
    for result in results:
        stage, per_microbatch = result["stage"], result["per_microbatch"]
        held = 2 - stage
        row = f"memory/pp_stage_{stage}/"
        assert logged[row + "microbatches_in_flight"] == chunks * held
        assert isinstance(logged[row + "microbatches_in_flight"], int)
        assert logged[row + "activations_gb"] * GB == pytest.approx(held * sum(per_microbatch), rel=0.02)
        mean = sum(per_microbatch) / len(per_microbatch)
        assert logged[row + "activations_per_microbatch_gb"] * GB == pytest.approx(mean, rel=0.02)
        # zero_grad(set_to_none=True) ran before the call: the iteration's gradients still count
        assert round(logged[row + "grads_gb"] * GB) == result["param_bytes"]
        assert math.isnan(logged.get(row + "temporaries_gb", math.nan))  # no allocator on CPU
    assert logged["memory/peak_stage/activations_gb"] == 0

    from nemo_memlog.measure import layer_record
    from nemo_memlog.offline.events import load_run

    written = load_run(tmp_path / "tb").per_stage("activations_gb")
    assert {s: written[s].values[-1] for s in written} == pytest.approx(
        {s: logged[f"memory/pp_stage_{s}/activations_gb"] for s in (0, 1)}, rel=1e-6
    )
    records = layer_record.read_folder(tmp_path / "records")
    assert [r["rank"] for r in records] == [0, 1, 2, 3] and all(
        r["pp_size"] == 2 and r["dp_size"] == 2 for r in records
    )
    for record, result in zip(records, results):  # both by rank
        layers = record["layers"]
        assert layers[-1]["kind"] == "other"
        assert sum(layer["params_gb"] for layer in layers) * GB == pytest.approx(record["stage"]["params_gb"] * GB)
        assert sum(layer["grads_gb"] for layer in layers) == pytest.approx(record["stage"]["params_gb"])
        per_layer = sum(layer["activations_per_microbatch_gb"] for layer in layers)
        assert per_layer * GB == pytest.approx(sum(result["per_microbatch"]), rel=0.02)


def test_the_call_before_a_logging_iteration_arms_and_closing_the_run_disarms():
    from nemo_memlog import LoggerConfig, close_writers, training_log

    cfg = LoggerConfig(log_memory_to_tensorboard=True, tensorboard_log_interval=3, memory_record_dir="off")
    model = blocks(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no writer configured
        training_log(1, cfg, model=model)  # iteration 2 does not log: nothing installed
        assert not any(m._forward_pre_hooks for m in model.modules())
        training_log(2, cfg, model=model)  # iteration 3 logs: armed from here
        assert any(m._forward_pre_hooks for m in model.modules())
        close_writers()  # the run ends before iteration 3: the hooks come off
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_a_forward_where_saved_tensor_hooks_are_disabled_runs_unmeasured():
    """Some libraries forbid saved-tensor hooks in a region (disable_saved_tensors_hooks): the
    meter must not fail that forward; it counts the microbatches it could see."""
    model = blocks(1)
    meter = ActivationMeter()
    meter.arm(model)
    with torch.autograd.graph.disable_saved_tensors_hooks("not here"):
        model(microbatch(0)).square().mean().backward()  # would raise if the meter pushed its hooks
    model(microbatch(1)).square().mean().backward()
    seen = meter.finish()
    assert seen.microbatches == 1 and seen.microbatches_in_flight == 1


@pytest.mark.parametrize("binding", ["missing", "changed signature", "odd result"])
def test_a_torch_without_the_hooks_reader_measures_nothing_and_never_fails_a_forward(monkeypatch, binding):
    """torch's private reader of the installed saved-tensor hooks is absent before about 2.8 and has
    changed signature: stood in for here (an older torch cannot be installed beside this one)."""
    from torch._C import _autograd

    stand_in = {
        "missing": None,
        "changed signature": lambda: None,  # takes no argument
        "odd result": lambda flag: "hooks",
    }[binding]
    if stand_in is None:
        monkeypatch.delattr(_autograd, "_top_saved_tensors_default_hooks")
    else:
        monkeypatch.setattr(_autograd, "_top_saved_tensors_default_hooks", stand_in)
    model = blocks(2)
    meter = ActivationMeter()
    meter.arm(model)
    assert meter.error is not None and "_top_saved_tensors_default_hooks" in meter.error
    assert not meter.armed
    loss = model(torch.randn(BATCH, WIDTH)).square().mean()
    loss.backward()  # trains as without the meter
    assert all(p.grad is not None for p in model.parameters())
    assert meter.finish() is None


class NoStorage(torch.Tensor):
    """A tensor subclass whose storage read raises ValueError (as some wrapper subclasses do):
    every op on it returns one of its kind, so it reaches the meter's layer pre-hooks, its
    saved-tensor hook and, through the weights' gradients' inputs, the rest."""

    def untyped_storage(self):
        raise ValueError("this subclass has no storage to show")


def test_a_tensor_whose_storage_read_raises_anything_is_counted_at_its_nominal_size_said_once(caplog):
    import logging

    from nemo_memlog import LoggerConfig, close_writers, training_log

    model = blocks(2)
    cfg = LoggerConfig(log_memory_to_tensorboard=True, tensorboard_log_interval=2, memory_record_dir="off")
    x = microbatch(0).as_subclass(NoStorage)
    with caplog.at_level(logging.WARNING, logger="nemo_memlog"), warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing may raise, whatever the filters
        warnings.filterwarnings("ignore", message=".*no writer is configured")
        for iteration in (1, 2, 3, 4):  # iteration 2 logs; 3 is armed, runs the subclass, and 4 logs it
            output = model(x)
            assert isinstance(output, NoStorage)
            output.square().mean().backward()
            logged = training_log(iteration, cfg, model=model)
        close_writers()
    said = [r.getMessage() for r in caplog.records if r.name == "nemo_memlog" and "NoStorage" in r.getMessage()]
    assert len(said) == 1 and "ValueError" in said[0] and "nominal size" in said[0], said
    # Counted at numel x element size: the first layer's input is x itself.
    meter = ActivationMeter()
    meter.arm(model)
    model(x).square().mean().backward()
    seen = meter.finish()
    assert seen.layer_inputs_gb[0] * GB == pytest.approx(x.numel() * x.element_size())
    assert seen.activations_gb > 0 and logged["memory/activations_gb"] > 0


def test_a_hook_that_fails_in_any_way_never_fails_the_iteration_and_is_said_once(caplog):
    """A failure inside a hook itself (not a tensor read): provoked by a layer whose hook-visible
    state is broken, which no real model does on purpose."""
    import logging

    model = blocks(2)
    meter = ActivationMeter()
    meter.arm(model)
    meter._session.layer_stack = None  # the layer hooks now fail with TypeError/AttributeError
    with caplog.at_level(logging.WARNING, logger="nemo_memlog"):
        for index in range(2):
            model(microbatch(index)).square().mean().backward()
    meter.finish()
    said = [r.getMessage() for r in caplog.records if r.name == "nemo_memlog"]
    assert said and all("activation meter's" in m and "training goes on" in m for m in said), said
    assert len(said) == len(set(said)), "each kind once"
