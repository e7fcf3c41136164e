"""Megatron-Bridge's training loop, driven on CPU gloo ranks, with its real pieces.

``pretrain()`` asserts CUDA, so this module replaces only the loop driver. Everything
it drives is the installed Megatron-Bridge's own (0.3.1 or 0.6.2): a real ``GlobalState``
and ``ConfigContainer``, the loggers it opens (``state.tensorboard_logger``, ``state.wandb_logger``,
``state.mlflow_logger``), its ``CallbackManager`` (``normalize_callbacks``), and its
``training_log``. ``train`` follows ``megatron.bridge.training.train.train``: the loggers
opened as its ``setup()`` opens them (TensorBoard and W&B; MLflow on first use),
``on_train_start``; per iteration ``on_train_step_start``, the train step,
``on_train_step_end``, ``train_state.step += 1``, ``training_log`` (which logs that
iteration at the incremented step); after the loop the TensorBoard flush,
``on_train_end``, and what ``_finish_train`` does to the loggers (``wandb.finish()``).
The CUDA calls Bridge makes are pointed at the CPU by ``nemo_memlog.testing.bridge_env``.

The train step is a real SGD step on a tiny model. Stage 0 also holds a ballast of host
memory, as a real first stage holds the most in-flight activations, so the pipeline's
peak (``peak_host_rss_gb``) lives on stage 0 and not on the last stage, where Bridge logs.

With ``RunSpec(megatron=JobSpec(...))`` the model is megatron-core's own: ``megatron_cpu.build``'s
GPTModel chunks in Megatron's DDP and its optimizer are the loop's ``model`` and ``optimizer`` (in
every CallbackContext, as Bridge's ``train()`` passes them), the recipe states the job's shape and
batch, and each iteration is Bridge's own ``train_step`` (``bridge_megatron.BridgeTrainStep``: Megatron's 1F1B
schedule over the microbatch calculator's count, the optimizer and scheduler steps, Bridge's
reductions). The rank's record then carries its per-layer record and the model state counted
apart (``RankRecord.megatron``). No ballast is needed there: stage 0 holds the most activations.

Each rank returns a ``RankRecord``: its coordinates, its own host peak around each
``on_train_step_end``, the collectives each callback event issued, and what the loop
handed Bridge's ``training_log`` at each step (so the test can check it is logged
unchanged). Run with ``cluster.run_ok(train, RunSpec(...))``. ``exit_early_then_train_again``
takes Bridge's ``should_exit`` path (``sys.exit`` before ``on_train_end``) and runs again.
"""

from __future__ import annotations

import logging.handlers
import os
from dataclasses import dataclass, field
from typing import Any

from . import bridge_env, bridge_megatron

MB = 2**20


@dataclass
class RunSpec:
    """One training run. ``root`` holds the last rank's logger directories."""

    root: str
    callback_kwargs: dict | None = None  # None: Bridge alone; else MemoryLogCallback(**callback_kwargs)
    log_memory_to_tensorboard: bool = True
    train_iters: int = 6
    tensorboard_log_interval: int = 2
    log_interval: int = 1
    ballast_mb: int = 300
    backends: tuple = ("tensorboard", "wandb", "mlflow")
    save_interval: int | None = None  # cfg.checkpoint.save_interval: a save staged at these steps (see _run)
    eval_at: tuple = ()  # steps after which Bridge's eval events fire, around an evaluation
    phase_ballast_mb: int = 150  # what stage 0 holds during a save or an evaluation
    #: A real megatron-core job (megatron_cpu.build): its GPTModel chunks in Megatron's DDP and its
    #: optimizer are the loop's model and optimizer, and each iteration is Bridge's own train_step.
    megatron: Any = None  # megatron_cpu.JobSpec | None

    @property
    def tensorboard_dir(self):
        return os.path.join(self.root, "tb")

    @property
    def wandb_save_dir(self):
        return os.path.join(self.root, "wandb_save")

    @property
    def mlflow_uri(self):
        return f"sqlite:///{self.root}/mlflow.db"

    def logging_steps(self):
        return [s for s in range(1, self.train_iters + 1) if s % self.tensorboard_log_interval == 0]


@dataclass
class StepRecord:
    """What the loop handed Bridge's training_log for one iteration, logged at ``step``."""

    step: int
    learning_rate: float
    loss: float | None  # None off the last stage: Megatron reduces the loss there only
    grad_norm: float | None  # None: Megatron's optimizer without clipping (a megatron job)
    batch_size: int
    consumed_train_samples: int
    peak_before: float  # this rank's peak_host_rss_gb just before on_train_step_end
    peak_after: float  # ... and just after
    flag_seen_by_training_log: bool


@dataclass
class RankRecord:
    rank: int
    pp_stage: int
    dp_rank: int
    steps: list = field(default_factory=list)
    collectives: dict = field(default_factory=dict)  # event (or "on_train_step_end@<step>") -> names
    flag_after_run: bool | None = None
    megatron: dict | None = None  # a megatron job's view (RunSpec.megatron): see bridge_megatron.view
    notices: list = field(default_factory=list)  # what the "nemo_memlog" logger said on this rank during the run


_ballast: list = []


def _host_peak_gb() -> float:
    from nemo_memlog import report_memory

    return report_memory()["peak_host_rss_gb"]


def recipe_config(spec: RunSpec, pp: int):
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.training import config as bc
    from megatron.bridge.training.tokenizers.config import TokenizerConfig

    logger = bc.LoggerConfig(
        log_interval=spec.log_interval,
        tensorboard_log_interval=spec.tensorboard_log_interval,
        log_memory_to_tensorboard=spec.log_memory_to_tensorboard,
        log_timers_to_tensorboard=True,  # iteration-time at every log_interval step: Bridge writes every step
    )
    if "tensorboard" in spec.backends:
        logger.tensorboard_dir = spec.tensorboard_dir
    if "wandb" in spec.backends:
        logger.wandb_project, logger.wandb_exp_name = "memlog-bridge", "pp-run"
        logger.wandb_save_dir = spec.wandb_save_dir
    if "mlflow" in spec.backends:
        logger.mlflow_experiment, logger.mlflow_run_name = "memlog-bridge", "pp-run"
        logger.mlflow_tracking_uri = spec.mlflow_uri
    job = spec.megatron
    if job is None:
        train = bc.TrainingConfig(micro_batch_size=1, global_batch_size=4, train_iters=spec.train_iters)
        shape = dict(
            num_layers=2, hidden_size=8, num_attention_heads=2, kv_channels=4, num_query_groups=2, ffn_hidden_size=32
        )
        seq, vocab = 16, 64
    else:  # the recipe states the megatron job's own shape and batch (Bridge's estimate reads it)
        import torch.distributed as dist

        data_parallel = dist.get_world_size() // (job.pp * job.tp)
        train = bc.TrainingConfig(
            micro_batch_size=job.micro_batch_size,
            global_batch_size=job.micro_batch_size * job.microbatches * data_parallel,
            train_iters=spec.train_iters,
        )
        shape = dict(  # what TransformerConfig derives for the job's model (Bridge's FLOPs read them unfinalised)
            num_layers=job.layers,
            hidden_size=job.hidden,
            num_attention_heads=job.heads,
            kv_channels=job.hidden // job.heads,
            num_query_groups=job.heads,
            ffn_hidden_size=4 * job.hidden,
        )
        seq, vocab = job.seq, job.vocab
    cfg = bc.ConfigContainer(
        train=train,
        model=GPTModelProvider(**shape, seq_length=seq, vocab_size=vocab, pipeline_model_parallel_size=pp),
        optimizer=bc.OptimizerConfig(lr=1e-3),
        scheduler=bc.SchedulerConfig(),
        dataset=bc.MockGPTDatasetConfig(random_seed=1, seq_length=seq),
        logger=logger,
        tokenizer=TokenizerConfig(),
        checkpoint=bc.CheckpointConfig(save=os.path.join(spec.root, "checkpoints"), save_interval=spec.save_interval),
    )
    cfg.set_data_parallel_size()
    return cfg


def _environment(spec: RunSpec) -> None:
    # W&B offline, and everything it writes under root (set on every rank; only the last opens it).
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        os.environ[name] = os.path.join(spec.root, name.lower())


def _train_step(model, optimizer, stage: int, last_stage: bool, iteration: int, spec: RunSpec):
    """One SGD step on a tiny model. (loss_dict, skipped_iter, grad_norm, num_zeros_in_grad)."""
    import numpy as np
    import torch

    if stage == 0 and spec.ballast_mb and not _ballast:
        _ballast.append(np.ones(spec.ballast_mb * MB // 8))  # touched: resident, not just reserved
    for group in optimizer.param_groups:
        group["lr"] = 1e-3 * (iteration + 1)  # a schedule, so each step's value is its own
    torch.manual_seed(iteration)
    loss = model[0](torch.randn(4, 8)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model[0].parameters(), 1e9))
    optimizer.step()
    loss_dict = {"lm loss": loss.detach()} if last_stage else {}
    return loss_dict, 0, grad_norm, None


def _fire(manager, event, record, key, **context_fields):
    from megatron.bridge.training.callbacks import CallbackContext, should_fire

    from nemo_memlog.testing.collectives import count_collectives

    if not should_fire(manager, event):
        return
    with count_collectives() as calls:
        manager.fire(event, CallbackContext(user_state=manager.user_state, **context_fields))
    record.collectives[key] = list(calls)


def train(spec: RunSpec) -> RankRecord:
    """Run Bridge's training loop on this rank; see the module docstring."""
    bridge_env.load()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    _environment(spec)
    job = None
    if spec.megatron is not None:
        from .megatron import cpu as megatron_cpu

        job = megatron_cpu.build(spec.megatron)  # Megatron's groups for the job, then its model and optimizer
    record = RankRecord(
        rank=dist.get_rank(), pp_stage=ps.get_pipeline_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank()
    )
    cfg = recipe_config(spec, ps.get_pipeline_model_parallel_world_size())
    notices = logging.handlers.BufferingHandler(capacity=1 << 20)
    logging.getLogger("nemo_memlog").addHandler(notices)
    try:
        _run(spec, cfg, _callbacks(spec), record, job)
    finally:
        logging.getLogger("nemo_memlog").removeHandler(notices)
    record.notices = [said.getMessage() for said in notices.buffer]
    if job is not None:
        record.megatron = bridge_megatron.view(spec.root, job, record)
    return record


def exit_early_then_train_again(spec: RunSpec, exit_interval: int) -> tuple[RankRecord, RankRecord]:
    """Bridge's ``should_exit`` path, then a second run of the same config in this process.

    Run 1 has ``cfg.train.exit_interval``: Bridge's own ``checkpoint_and_decide_exit``
    decides to exit at that step, and the loop does what ``train()`` does then (flush
    TensorBoard, finish W&B, ``sys.exit``: no ``on_train_end``). The ``SystemExit`` is
    caught here, as a driver that runs ``pretrain`` again (or an in-process restart)
    catches it. Run 2 trains the same ``cfg`` object to the end with a new callback."""
    bridge_env.load()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    _environment(spec)
    cfg = recipe_config(spec, ps.get_pipeline_model_parallel_world_size())
    cfg.checkpoint.save = None  # the exit path saves a checkpoint if asked: not on a CPU
    records = [
        RankRecord(
            rank=dist.get_rank(), pp_stage=ps.get_pipeline_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank()
        )
        for _ in range(2)
    ]
    cfg.train.exit_interval = exit_interval
    try:
        _run(spec, cfg, _callbacks(spec), records[0])
        raise AssertionError(f"Bridge did not exit at exit_interval={exit_interval}")
    except SystemExit:
        pass
    records[0].flag_after_run = cfg.logger.log_memory_to_tensorboard
    cfg.train.exit_interval = None
    _run(spec, cfg, _callbacks(spec), records[1])
    return records[0], records[1]


def _callbacks(spec: RunSpec):
    """Bridge's CallbackManager over a new MemoryLogCallback (None: Bridge alone)."""
    if spec.callback_kwargs is None:
        return None
    from megatron.bridge.training.callbacks import normalize_callbacks

    from nemo_memlog.bridge import MemoryLogCallback

    return normalize_callbacks([MemoryLogCallback(**spec.callback_kwargs)])


def _phases(spec: RunSpec, manager, record, events, stage: int, step: int) -> None:
    """Where Bridge's train loop evaluates and saves after a step: its eval events around an
    evaluation, and a save (stage 0 stages ``phase_ballast_mb`` of state) ended by
    ``on_checkpoint_save`` where the installed Bridge has that event (0.4+) and fires it at once.
    Bridge's own save_checkpoint is not run: it writes torch distributed checkpoints of a real model."""
    import numpy

    def work():
        if stage == 0:
            ballast = numpy.full(spec.phase_ballast_mb * 2**20, 1, dtype=numpy.uint8)
            del ballast

    if step in spec.eval_at:
        _fire(manager, "on_eval_start", record, f"on_eval_start@{step}", **events)
        work()
        _fire(manager, "on_eval_end", record, f"on_eval_end@{step}", **events)
    if spec.save_interval and step % spec.save_interval == 0:
        work()
        from megatron.bridge.training import callbacks

        if "on_checkpoint_save" in callbacks.VALID_EVENTS:
            _fire(manager, "on_checkpoint_save", record, f"on_checkpoint_save@{step}", **events)


def _run(spec: RunSpec, cfg, manager, record: RankRecord, job=None) -> None:
    """One run of Bridge's training loop over ``cfg`` (a fresh GlobalState), into ``record``;
    with ``job`` (megatron_cpu.build), on its model and optimizer, each step Bridge's train_step."""
    import sys

    import torch
    from megatron.bridge.training.state import GlobalState
    from megatron.bridge.training.utils.train_utils import training_log
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        get_num_microbatches,
        init_num_microbatches_calculator,
    )

    stage = ps.get_pipeline_model_parallel_rank()
    state = GlobalState()
    assert state.cfg is None, "GlobalState must be fresh per run"
    state.cfg = cfg
    init_num_microbatches_calculator(
        record.rank, None, cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.data_parallel_size
    )
    if job is None:
        model = [torch.nn.Linear(8, 8)]
        optimizer = torch.optim.SGD(model[0].parameters(), lr=1e-3)
        for group in optimizer.param_groups:
            group["is_decoupled_lr"] = False
        scheduler, bridge_step = None, None
    else:
        assert get_num_microbatches() == job.spec.microbatches, "the recipe's batch is the job's"
        model, optimizer = job.model, job.optimizer
        bridge_step = bridge_megatron.BridgeTrainStep(job, state)
        scheduler = bridge_step.scheduler
    events = dict(state=state, model=model, optimizer=optimizer, scheduler=scheduler)
    try:
        with bridge_env.cpu_redirects():
            state.tensorboard_logger, state.wandb_logger  # noqa: B018 -- opened where Bridge's setup() opens them
            total_loss_dict: dict = {}
            state.timers("interval-time", log_level=0).start(barrier=True)
            report_memory_flag = False  # True would print torch.cuda.memory_stats text once
            _fire(manager, "on_train_start", record, "on_train_start", **events)
            should_exit = False
            while state.train_state.step < cfg.train.train_iters and not should_exit:
                iteration = state.train_state.step
                _fire(manager, "on_train_step_start", record, f"on_train_step_start@{iteration + 1}", **events)
                if bridge_step is None:
                    loss_dict, skipped_iter, grad_norm, num_zeros = _train_step(
                        model, optimizer, stage, ps.is_pipeline_last_stage(), iteration, spec
                    )
                else:
                    loss_dict, skipped_iter, grad_norm, num_zeros = bridge_step()
                peak_before = _host_peak_gb()
                _fire(
                    manager,
                    "on_train_step_end",
                    record,
                    f"on_train_step_end@{iteration + 1}",
                    **events,
                    loss_dict=loss_dict,
                    grad_norm=grad_norm,
                    skipped_iter=bool(skipped_iter),
                )
                peak_after = _host_peak_gb()
                state.train_state.step += 1
                batch_size = ps.get_data_parallel_world_size() * cfg.train.micro_batch_size * get_num_microbatches()
                state.train_state.consumed_train_samples += batch_size
                learning_rate = optimizer.param_groups[0]["lr"]
                record.steps.append(
                    StepRecord(
                        step=state.train_state.step,
                        learning_rate=learning_rate,
                        loss=float(loss_dict["lm loss"]) if loss_dict else None,
                        grad_norm=grad_norm,
                        batch_size=batch_size,
                        consumed_train_samples=state.train_state.consumed_train_samples,
                        peak_before=peak_before,
                        peak_after=peak_after,
                        flag_seen_by_training_log=cfg.logger.log_memory_to_tensorboard,
                    )
                )
                report_memory_flag = training_log(
                    loss_dict,
                    total_loss_dict,
                    learning_rate,
                    None,
                    1.0,
                    report_memory_flag,
                    skipped_iter,
                    grad_norm,
                    None,
                    num_zeros,
                    cfg,
                    state,
                    None,
                    model,
                )  # keyword-only after model from 0.6
                _phases(spec, manager, record, events, stage, state.train_state.step)
                if cfg.train.exit_interval:  # Bridge's own decision (its checkpoint manager/context: unused)
                    from megatron.bridge.training.train import checkpoint_and_decide_exit  # imports ModelOpt: slow

                    should_exit = checkpoint_and_decide_exit(state, model, optimizer, None, 0.0, None, None)
            if state.tensorboard_logger:
                state.tensorboard_logger.flush()
            if should_exit:  # what train() does then: no on_train_end
                if state.wandb_logger:
                    state.wandb_logger.finish()
                sys.exit(0)
            _fire(manager, "on_train_end", record, "on_train_end", **events)
            if state.wandb_logger:
                state.wandb_logger.finish()  # as _finish_train does
        record.flag_after_run = cfg.logger.log_memory_to_tensorboard
    finally:
        _close_what_bridge_leaves_open(state)
        destroy_num_microbatches_calculator()
        _ballast.clear()


def _close_what_bridge_leaves_open(state) -> None:
    """Bridge never closes its SummaryWriter or ends its MLflow run (its process exits);
    these rank processes host several runs, so the next one must start clean."""
    if state._tensorboard_logger is not None:
        state._tensorboard_logger.close()
    if state._mlflow_logger is not None:
        state._mlflow_logger.end_run()


def end_runs() -> None:
    """The last task of a module's cluster: close what the runs left open (the runs
    training_log started, W&B's service) while every rank is still alive, and have the rank
    leave at once when its cluster sends it off. Left to interpreter exit, the ranks of a
    cluster that ran Bridge sat 10-17 s in native teardown, after every Python exit hook."""
    import atexit
    import sys

    from nemo_memlog import close_writers

    close_writers()
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()
    # Registered last, so it runs first at exit: after multiprocessing has flushed the
    # results queue (that happens before exit hooks run), before the native teardown.
    atexit.register(os._exit, 0)
