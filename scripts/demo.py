"""The demo: train a small pipeline-parallel transformer on 4 processes, log where memory peaks.

    python scripts/demo.py [section.key=value ...]      # re-launches itself under torchrun, 4 processes
    torchrun --nproc-per-node 4 scripts/demo.py ...     # the same, launched by you (or SLURM, several nodes)

Overrides, e.g. ``train.iters=40 model.hidden=256 parallel.pp=2 logger.tensorboard_log_interval=5``:
``train``, ``model``, ``parallel``, ``run`` are below; ``logger`` is nemo_memlog's LoggerConfig.
``logger.memory_peak_window=interval`` logs each interval's peaks (peak since the previous
logging step) instead of the run's, so the peak_* lines can fall as well as rise.
Everything lands in ``<run.root>/<run.name>/``: TensorBoard events, an MLflow SQLite store, a
W&B offline run and a Comet offline archive. No accounts, no servers, no GPU needed.

Devices: with a GPU per process on the node (4 processes: 4 GPUs) every stage runs on its
own GPU over NCCL; with fewer GPUs the stages run on CPU over gloo, with a one-line note.

Every iteration every rank calls ``nemo_memlog.training_log``; at the end the last rank prints
each stage's peak host RSS next to the logged pipeline-wide peak, and how to open each dashboard.
The model and the 1F1B schedule live in demo_model.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from tqdm import tqdm

import nemo_memlog
from demo_model import Pipeline, build_stage, learning_rate, one_f_one_b, synthetic_microbatch

DEFAULT_PROCESSES = 4


@dataclass
class TrainConfig:
    iters: int = 8
    """The default job takes about 50 s on 2 idle CPU cores, most of it starting 4 processes."""
    micro_batches: int = 4
    """Microbatches per iteration; >= parallel.pp keeps the first stage's 1F1B warm-up full."""
    micro_batch_size: int = 128
    """With seq_len and model.hidden, sets the activation memory a microbatch keeps on a stage:
    about 0.15 GB here. The first stage keeps 3 more of them than the last. (With
    logger.writer_mode=thread the last stage, the writer rank, also holds the ~0.2 GB of
    logging backends; in the default writer process it does not.)"""
    seq_len: int = 128
    lr: float = 1e-2
    seed: int = 1234


@dataclass
class ModelConfig:
    hidden: int = 64
    layers_per_stage: int = 2
    vocab: int = 128
    heads: int = 4


@dataclass
class ParallelConfig:
    pp: int = 4
    """Pipeline stages; the rest of the processes is data parallelism (4 processes, pp=2: DP 2)."""


@dataclass
class RunConfig:
    name: str = "demo"
    root: str = "runs"


@dataclass
class DemoConfig:
    train: TrainConfig = field(default_factory=TrainConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)
    logger: Any = None
    """nemo_memlog.LoggerConfig, built by load_config from the run directory and logger.* overrides."""


class ConfigError(ValueError):
    pass


def load_config(overrides: list[str]) -> DemoConfig:
    """Defaults plus dotted ``section.key=value`` overrides. Raises ConfigError naming the bad one."""
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"bad argument {item!r}: expected section.key=value, sections: "
                              f"train, model, parallel, run, logger")
    ours = [item for item in overrides if not item.startswith("logger.")]
    try:
        merged = OmegaConf.merge(OmegaConf.structured(DemoConfig), OmegaConf.from_dotlist(ours))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise ConfigError(f"bad override in {ours!r}: {str(error.msg).splitlines()[0]}") from None
    try:
        cfg.logger = nemo_memlog.from_overrides(overrides, base=logger_defaults(cfg.run))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    _check(cfg)
    return cfg


def logger_defaults(run: RunConfig):
    """Every backend on, all writing under the run directory: nothing to sign up for or serve."""
    run_dir = Path(run.root) / run.name
    project = "nemo_memlog-demo"
    return nemo_memlog.LoggerConfig(
        log_memory_to_tensorboard=True,
        tensorboard_log_interval=1,
        tensorboard_dir=str(run_dir / "tensorboard"),
        wandb_project=project,
        wandb_exp_name=run.name,
        wandb_save_dir=str(run_dir),
        mlflow_experiment=project,
        mlflow_run_name=run.name,
        mlflow_tracking_uri=f"sqlite:///{(run_dir / 'mlflow.db').resolve()}",
        comet_project=project,
        comet_experiment_name=run.name,
        comet_offline_directory=str(run_dir / "comet"),
    )


def _check(cfg: DemoConfig) -> None:
    positive = {"train.iters": cfg.train.iters, "train.micro_batches": cfg.train.micro_batches,
                "train.micro_batch_size": cfg.train.micro_batch_size, "train.seq_len": cfg.train.seq_len,
                "model.hidden": cfg.model.hidden, "model.layers_per_stage": cfg.model.layers_per_stage,
                "model.vocab": cfg.model.vocab, "model.heads": cfg.model.heads, "parallel.pp": cfg.parallel.pp}
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"{name} must be >= 1; got {value}")
    if cfg.model.hidden % cfg.model.heads:
        raise ConfigError(f"model.hidden ({cfg.model.hidden}) must be a multiple of model.heads ({cfg.model.heads})")
    world = int(os.environ.get("WORLD_SIZE", DEFAULT_PROCESSES))
    if world % cfg.parallel.pp:
        raise ConfigError(f"parallel.pp ({cfg.parallel.pp}) must divide the number of processes ({world})")


def relaunch(overrides: list[str]) -> int:
    """Run this script under torchrun with DEFAULT_PROCESSES local processes; its exit code."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(DEFAULT_PROCESSES),
               "--master-port", str(_free_port()), __file__, *overrides]
    try:
        return subprocess.call(command, env=env)
    except KeyboardInterrupt:  # torchrun got the same Ctrl-C and stops the ranks
        return 130


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train(cfg: DemoConfig) -> None:
    """One torchrun process: join the pipeline, train, log every iteration, report at the end."""
    # Imported here, not at the top: the launching process has no use for its ~7 s import.
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex")
    from megatron.core import parallel_state as ps

    torch.set_num_threads(1)
    device = stage_device()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ps.initialize_model_parallel(pipeline_model_parallel_size=cfg.parallel.pp)
    dist.barrier()  # every rank joins the default group before the first pairwise send (NCCL)
    pipe = _pipeline(ps, device)
    last_logged = _train_loop(cfg, pipe, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                              ps.get_data_parallel_group())
    if dist.get_rank() == dist.get_world_size() - 1:  # nemo_memlog's writer rank
        nemo_memlog.close_writers()  # every backend flushed before the paths below are printed
        print(summary(cfg, last_logged), flush=True)
    dist.destroy_process_group()


def stage_device() -> torch.device:
    """This process's GPU when the node has one per process; else the CPU, with a one-line note
    (rank 0). NCCL refuses two ranks on one GPU, so fewer GPUs than processes means CPU."""
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0  # creates no CUDA context
    if gpus >= processes:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if gpus and os.environ.get("RANK", "0") == "0":
        print(f"demo.py: {processes} processes on this node but {gpus} GPU(s): the stages run on CPU (gloo).",
              file=sys.stderr, flush=True)
    return torch.device("cpu")


def _train_loop(cfg: DemoConfig, pipe: Pipeline, dp_rank: int, dp_size: int, dp_group):
    """The iterations; training_log on every rank each one. (iteration, dict) it last returned, or None."""
    writer = dist.get_rank() == dist.get_world_size() - 1  # a last stage: it has the loss to show
    if writer:
        (Path(cfg.run.root) / cfg.run.name).mkdir(parents=True, exist_ok=True)

    t = cfg.train
    module = build_stage(cfg.model, t.seq_len, pipe, t.seed)
    optimizer = torch.optim.Adam(module.parameters(), lr=t.lr)
    hidden_shape = (t.micro_batch_size, t.seq_len, cfg.model.hidden)
    last_logged = None
    progress = tqdm(range(1, t.iters + 1), desc=f"training ({dist.get_world_size()} processes, PP {pipe.stages})",
                    unit="it", disable=not writer)
    for iteration in progress:
        lr = learning_rate(iteration, t.iters, t.lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss = one_f_one_b(module, pipe, t.micro_batches,
                           lambda index: synthetic_microbatch(t, cfg.model.vocab, iteration, dp_rank, index),
                           hidden_shape)
        if dp_size > 1:
            loss = _average_over_data_parallel(module, loss, dp_group, dp_size)
        optimizer.step()
        metrics = {"lr": lr} if loss is None else {"lr": lr, "loss": loss}  # only last stages have a loss
        logged = nemo_memlog.training_log(iteration, cfg, metrics=metrics)
        if logged is not None:
            last_logged = (iteration, logged)
        if loss is not None:
            progress.set_postfix(loss=f"{loss:.3f}")
    progress.close()
    return last_logged


def _pipeline(ps, device: torch.device) -> Pipeline:
    stage, stages = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    # megatron-core's next/prev ranks wrap around the ring; a pipeline has two ends.
    return Pipeline(
        stage=stage,
        stages=stages,
        prev_rank=None if stage == 0 else ps.get_pipeline_model_parallel_prev_rank(),
        next_rank=None if stage == stages - 1 else ps.get_pipeline_model_parallel_next_rank(),
        device=device,
    )


def _average_over_data_parallel(module, loss, dp_group, dp_size):
    """Average gradients (every stage) and the loss (last stages) over the data-parallel replicas."""
    for param in module.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, group=dp_group)
            param.grad /= dp_size
    if loss is None:
        return None
    total = torch.tensor([loss], device=next(module.parameters()).device)
    dist.all_reduce(total, group=dp_group)
    return float(total) / dp_size


def summary(cfg: DemoConfig, last_logged) -> str:
    """The closing report: per-stage peaks vs the logged pipeline peak, and the dashboards."""
    lines = [""]
    if last_logged is None:
        lines.append("No memory was logged: turn on logger.log_memory_to_tensorboard, or make train.iters "
                     ">= logger.tensorboard_log_interval.")
    else:
        iteration, logged = last_logged
        for name, label in TABLES:
            if f"memory/{name}" in logged:
                lines += _stage_table(cfg, iteration, logged, name, label)
    lines += ["", "Open the dashboards:"] + [f"  {command}" for command in dashboard_commands(cfg.logger)]
    return "\n".join(lines)


#: (logged name, label) of the closing tables: host RSS always; CUDA memory when a GPU was used.
TABLES = (("peak_host_rss_gb", "peak host RSS"), ("peak_allocated_gb", "peak CUDA allocated"))


def _stage_table(cfg: DemoConfig, iteration: int, logged: dict, name: str, label: str) -> list[str]:
    stages = sorted(int(key.split("/")[1].removeprefix("pp_stage_")) for key in logged
                    if key.startswith("memory/pp_stage_") and key.endswith("/" + name))
    peak, peak_stage = logged[f"memory/{name}"], logged[f"memory/peak_stage/{name}"]
    window = " (since the previous logging step)" if cfg.logger.memory_peak_window == "interval" else ""
    lines = [f"{label[0].upper() + label[1:]} per pipeline stage at iteration {iteration}{window} "
             f"(memory/pp_stage_{{i}}/{name}):",
             f"  stage   microbatches in flight   {label}"]
    last = len(stages) - 1
    for stage in stages:
        in_flight = min(len(stages) - stage, cfg.train.micro_batches)
        notes = []
        if stage == peak_stage:
            notes.append("<- pipeline peak")
        if stage == last and cfg.logger.writer_mode == "thread":
            notes.append("(also runs the logging backends)")
        lines.append(f"  {stage:>5}   {in_flight:>22}   {logged[f'memory/pp_stage_{stage}/{name}']:>10.3f} GB  "
                     + " ".join(notes))
    lines.append(f"  logged: memory/{name} = {peak:.3f} GB, memory/peak_stage/{name} = {peak_stage}")
    if last > 0:
        first_minus_last = logged[f"memory/pp_stage_0/{name}"] - logged[f"memory/pp_stage_{last}/{name}"]
        lines.append(f"  stage 0 - stage {last}: {1000 * first_minus_last:+.0f} MB")
    return lines


def dashboard_commands(logger) -> list[str]:
    """How to open what each enabled backend wrote (call after the writers are closed)."""
    commands = []
    if logger.tensorboard_dir:
        commands.append(f"tensorboard --logdir {logger.tensorboard_dir}")
    if logger.mlflow_experiment:
        commands.append(f"mlflow ui --backend-store-uri {logger.mlflow_tracking_uri}")
    if logger.wandb_project and os.environ.get("WANDB_MODE") == "offline":
        found = _newest(Path(logger.wandb_save_dir or ".") / "wandb", "offline-run-*")
        commands.append(f"wandb sync {found or Path(logger.wandb_save_dir or '.') / 'wandb' / 'offline-run-*'}")
    if logger.comet_project and logger.comet_offline_directory:
        found = _newest(Path(logger.comet_offline_directory), "*.zip")
        commands.append(f"comet upload {found or Path(logger.comet_offline_directory) / '*.zip'}")
    return commands


def _newest(folder: Path, pattern: str) -> Path | None:
    matches = sorted(folder.glob(pattern), key=lambda path: path.stat().st_mtime)
    return matches[-1] if matches else None


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    os.environ.setdefault("WANDB_MODE", "offline")  # no account: an offline run to `wandb sync` later
    os.environ.setdefault("WANDB_SILENT", "true")  # its run summary would bury the table below
    try:
        cfg = load_config(argv)
    except ConfigError as error:
        print(f"demo.py: {error}", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        return relaunch(argv)
    train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
