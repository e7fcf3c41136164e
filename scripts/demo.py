"""The demo: train megatron-core's GPTModel pipeline-parallel on 4 processes, log where memory peaks.

    python scripts/demo.py [section.key=value ...]      # re-launches itself under torchrun, 4 processes
    torchrun --nproc-per-node 4 scripts/demo.py ...     # the same, launched by you (or SLURM, several nodes)

Overrides, e.g. ``train.iters=40 model.hidden=256 parallel.pp=2 logger.tensorboard_log_interval=5``:
every key and its default is listed below; ``logger`` is nemo_memlog's LoggerConfig.
``logger.memory_peak_window=interval`` logs each interval's peaks (peak since the previous
logging step) instead of the run's, so the peak_* lines can fall as well as rise.
``logger.otel_metrics=true`` also exports every stage as OpenTelemetry metrics, where the OTEL_*
variables say (``OTEL_EXPORTER_OTLP_ENDPOINT``, or ``OTEL_METRICS_EXPORTER=prometheus``; docs/writers.md).
Each run lands in a folder of its own, ``<run.root>/<run.name>/`` (by default a new
``runs/demo-<date>-<time>``; an existing run.name is refused unless run.overwrite=true):
TensorBoard events, an MLflow SQLite store, a W&B offline run and a Comet offline archive.
No accounts, no servers, no GPU needed to run it (only uploading the W&B and Comet copies
needs an account).

The job is megatron-core's own: GPTModel (local layer spec) in Megatron's DistributedDataParallel,
Megatron's Adam and get_forward_backward_func()'s schedule, 1F1B (or interleaved: parallel.vpp=2).
Devices: with a GPU per process on the node (4 processes: 4 GPUs) every stage runs on its
own GPU over NCCL, Megatron as it is; with fewer GPUs the stages run on CPU over gloo, with a
one-line note, through nemo_memlog.testing.megatron.cpu's stand-ins for Megatron's GPU
assumptions (one line at start names them).

Every iteration every rank calls ``nemo_memlog.training_log``; at the end the last rank prints
each stage's peak host RSS next to the logged pipeline-wide peak, the ``nemo-memlog report``
and ``nemo-memlog postmortem`` commands for the run, and how to open each dashboard.

A failure to read: ``python scripts/demo.py fail.kill_stage=0`` SIGKILLs the first rank of
pipeline stage 0 in the middle of the run, as the kernel's OOM killer would, and then prints
the ``nemo-memlog postmortem`` command that says which rank died first and what every rank held
(about a minute on 2 CPU cores; the ranks' own output goes to torchrun.log in the run folder).
Building and stepping the Megatron job lives in demo_model.py.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
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
import nemo_memlog.config
from demo_model import DemoJob, build_job, learning_rate
from nemo_memlog.commands import console_command, postmortem_command, report_command
from nemo_memlog.config import did_you_mean
from nemo_memlog.config.schema import PROBE_DIR_ENV
from nemo_memlog.testing.cluster import free_port
from nemo_memlog.testing.megatron import cpu as megatron_cpu
from nemo_memlog.testing.tmp import private_tmpdir
from ticker import ticking

DEFAULT_PROCESSES = 4
#: The file the launcher's "starting" line ticks until (rank 0 creates it when it starts to say what it
#: does): set by relaunch() for the ranks it starts, absent under a torchrun of the user's.
STARTED_ENV = "DEMO_STARTED_FLAG"


@dataclass
class TrainConfig:
    iters: int = 8
    """Training iterations. The default job takes about 2 min on 2 idle CPU cores, 40 s of it setting up 4 processes."""
    micro_batches: int = 4
    """Microbatches per iteration; >= parallel.pp keeps the first stage's 1F1B warm-up full.
    (The interleaved schedule needs a multiple of parallel.pp.)"""
    micro_batch_size: int = 128
    """With seq_len and model.hidden, sets the activation memory a microbatch keeps on a stage:
    about 0.2 GB here (Megatron's unfused attention keeps its scores). The first stage keeps
    3 more of them than the last. (With logger.writer_mode=thread the last stage, the writer
    rank, also holds the ~0.2 GB of logging backends; in the default writer process it does not.)"""
    global_batch_size: int | None = None
    """Samples per iteration over the data-parallel replicas, as Megatron's global_batch_size: when set,
    train.micro_batches is global_batch_size / (micro_batch_size x DP), so that a micro-batch size
    change keeps the global batch (``nemo-memlog fit`` changes only the size: docs/fit.md)."""
    seq_len: int = 128
    """Tokens per sample."""
    lr: float = 3e-3
    """Peak learning rate (warm-up, then cosine decay)."""
    seed: int = 1234
    """Seed of the weights and the synthetic data."""
    save_every: int = 4
    """Save a checkpoint (each stage its weights and Adam state) every N iterations, inside a memory phase; 0: never."""


@dataclass
class ModelConfig:
    hidden: int = 64
    """Model width."""
    layers_per_stage: int = 2
    """Transformer layers on each pipeline stage: Megatron's num_layers is this x parallel.pp.
    With parallel.vpp, a stage's layers are split evenly among its model chunks."""
    vocab: int = 128
    """Vocabulary size (the loss starts near ln(vocab))."""
    heads: int = 4
    """Attention heads; must divide model.hidden."""


@dataclass
class ParallelConfig:
    pp: int = 4
    """Pipeline stages; the rest of the processes is data parallelism (4 processes, pp=2: DP 2)."""
    processes: int | None = None
    """Processes the demo starts (null: 4), a multiple of parallel.pp; under your torchrun, its --nproc-per-node."""
    vpp: int | None = None
    """Virtual pipeline size: model chunks per stage, run on Megatron's interleaved schedule; null or 1: 1F1B."""


@dataclass
class FailConfig:
    kill_stage: int | None = None
    """Pipeline stage whose first rank SIGKILLs itself mid-run, as the OOM killer would, for a post-mortem to read."""
    kill_at: int | None = None
    """The iteration it dies at (default: the middle of the run, past the first logging step)."""


@dataclass
class RunConfig:
    name: str | None = None
    """The run's folder under root; default: a new demo-<date>-<time> for every run."""
    root: str = "runs"
    """The folder holding every run's folder."""
    overwrite: bool = False
    """Delete an existing run.name folder and start again (refused otherwise: runs never mix)."""


@dataclass
class DemoConfig:
    train: TrainConfig = field(default_factory=TrainConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)
    fail: FailConfig = field(default_factory=FailConfig)
    logger: Any = None
    """nemo_memlog.LoggerConfig, built by load_config from the run directory and logger.* overrides."""


class ConfigError(ValueError):
    pass


#: Our sections (dotted-override prefix -> dataclass); "logger" is nemo_memlog's LoggerConfig.
SECTIONS = {
    "train": TrainConfig,
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "run": RunConfig,
    "fail": FailConfig,
}


def load_config(overrides: list[str]) -> DemoConfig:
    """Defaults plus dotted ``section.key=value`` overrides. Raises ConfigError naming the bad
    one and the valid keys. ``run.name`` stays None unless given (see claim_run_dir)."""
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(
                f"bad argument {item!r}: expected section.key=value, sections: "
                f"{', '.join(SECTIONS)}, logger (--help lists every key)"
            )
    ours = [item for item in overrides if not item.startswith("logger.")]
    for item in ours:
        _check_key(item)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(DemoConfig), OmegaConf.from_dotlist(ours))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise ConfigError(f"bad override in {ours!r}: {str(error.msg).splitlines()[0]}") from None
    probe = os.environ.get(PROBE_DIR_ENV)
    if probe and not any(item.startswith("run.root=") for item in ours):
        cfg.run.root = os.path.join(probe, "runs")  # a probe of nemo-memlog fit: in fit's folder, not among your runs
    try:
        cfg.logger = nemo_memlog.from_overrides(overrides, base=logger_defaults(cfg.run))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    _check(cfg)
    return cfg


def _check_key(item: str) -> None:
    """A ``section.key=value`` override names a known section and key; else ConfigError listing them."""
    section, _, key = item.split("=", 1)[0].partition(".")
    if section not in SECTIONS:
        raise ConfigError(
            f"bad override {item!r}: no section {section!r}{did_you_mean(section, [*SECTIONS, 'logger'])}; "
            f"sections: {', '.join(SECTIONS)}, logger (--help lists every key)"
        )
    schema = SECTIONS[section]
    names = [f.name for f in dataclasses.fields(schema)]
    if key.split(".")[0] not in names:
        raise ConfigError(
            f"bad override {item!r}: Key {key!r} not in {schema.__name__!r}"
            f"{did_you_mean(key, names)}; {section} keys: {', '.join(names)}"
        )


def logger_defaults(run: RunConfig):
    """Every backend on, all writing under the run directory: nothing to sign up for or serve."""
    name = run.name or PENDING_NAME
    run_dir = Path(run.root) / name
    project = "nemo_memlog-demo"
    return nemo_memlog.LoggerConfig(
        log_memory_to_tensorboard=True,
        tensorboard_log_interval=1,
        tensorboard_dir=str(run_dir / "tensorboard"),
        wandb_project=project,
        wandb_exp_name=name,
        wandb_save_dir=str(run_dir),
        mlflow_experiment=project,
        mlflow_run_name=name,
        mlflow_tracking_uri=f"sqlite:///{(run_dir / 'mlflow.db').resolve()}",
        comet_project=project,
        comet_experiment_name=name,
        comet_offline_directory=str(run_dir / "comet"),
    )


def _check(cfg: DemoConfig) -> None:
    world = processes(cfg)
    positive = {
        "train.iters": cfg.train.iters,
        "train.micro_batches": cfg.train.micro_batches,
        "train.micro_batch_size": cfg.train.micro_batch_size,
        "train.seq_len": cfg.train.seq_len,
        "model.hidden": cfg.model.hidden,
        "model.layers_per_stage": cfg.model.layers_per_stage,
        "model.vocab": cfg.model.vocab,
        "model.heads": cfg.model.heads,
        "parallel.pp": cfg.parallel.pp,
        "parallel.processes": world,
    }
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"{name} must be >= 1; got {value}")
    if cfg.model.hidden % cfg.model.heads:
        raise ConfigError(f"model.hidden ({cfg.model.hidden}) must be a multiple of model.heads ({cfg.model.heads})")
    _global_batch(cfg, world)
    _check_vpp(cfg)
    _check_fail(cfg)
    if world % cfg.parallel.pp:
        fitting = [str(pp) for pp in range(1, world + 1) if world % pp == 0]
        pp = cfg.parallel.pp
        ours = "" if "WORLD_SIZE" in os.environ else f"parallel.processes={pp} (or a multiple of it), "
        raise ConfigError(
            f"parallel.pp ({pp}) must divide the number of processes ({world}): choose parallel.pp among "
            f"{', '.join(fitting)}, or {ours}or start the demo on N processes yourself, N a multiple of {pp}: "
            f"{console_command('torchrun')} --nproc-per-node N scripts/demo.py parallel.pp={pp} ..."
        )


def processes(cfg: DemoConfig) -> int:
    """How many processes the job has: torchrun's (WORLD_SIZE) under a torchrun, else parallel.processes
    (4 when null). ConfigError where parallel.processes names another count than torchrun's."""
    asked = cfg.parallel.processes
    if "WORLD_SIZE" not in os.environ:
        return DEFAULT_PROCESSES if asked is None else asked
    world = int(os.environ["WORLD_SIZE"])
    if asked is not None and asked != world:
        raise ConfigError(
            f"parallel.processes={asked}, but torchrun started {world} processes: leave parallel.processes "
            f"out under a torchrun of yours (its --nproc-per-node is the count), or give it {world}"
        )
    return world


def _global_batch(cfg: DemoConfig, world: int) -> None:
    """train.micro_batches from train.global_batch_size, where it is set; ConfigError where not whole."""
    t = cfg.train
    if t.global_batch_size is None:
        return
    dp = max(world // cfg.parallel.pp, 1)
    microbatches, rest = divmod(t.global_batch_size, t.micro_batch_size * dp)
    if rest or microbatches < 1:
        raise ConfigError(
            f"train.global_batch_size ({t.global_batch_size}) must be a multiple of train.micro_batch_size "
            f"({t.micro_batch_size}) x DP ({dp})"
        )
    t.micro_batches = microbatches


def _check_vpp(cfg: DemoConfig) -> None:
    """parallel.vpp: null or 1 is 1F1B; more splits each stage's layers into chunks, as Megatron's
    interleaved schedule needs them (each chunk a whole number of layers, microbatches in groups of parallel.pp)."""
    vpp, pp = cfg.parallel.vpp, cfg.parallel.pp
    if vpp is None or vpp == 1:
        cfg.parallel.vpp = None
        return
    if vpp < 1:
        raise ConfigError(f"parallel.vpp must be >= 1 (or null); got {vpp}")
    if pp < 2:
        raise ConfigError(f"parallel.vpp={vpp} (the interleaved schedule) needs parallel.pp >= 2; got {pp}")
    if cfg.model.layers_per_stage % vpp:
        raise ConfigError(
            f"parallel.vpp ({vpp}) must divide model.layers_per_stage ({cfg.model.layers_per_stage}): "
            "each model chunk holds a whole number of layers"
        )
    if cfg.train.micro_batches % pp:
        raise ConfigError(
            f"parallel.vpp={vpp}: Megatron's interleaved schedule needs train.micro_batches "
            f"({cfg.train.micro_batches}) to be a multiple of parallel.pp ({pp})"
        )


def job_spec(cfg: DemoConfig, tp: int = 1) -> megatron_cpu.JobSpec:
    """The demo's keys as megatron_cpu's JobSpec (the Megatron job's shape)."""
    return megatron_cpu.JobSpec(
        pp=cfg.parallel.pp,
        tp=tp,
        vpp=cfg.parallel.vpp,
        layers=cfg.model.layers_per_stage * cfg.parallel.pp,
        hidden=cfg.model.hidden,
        heads=cfg.model.heads,
        seq=cfg.train.seq_len,
        vocab=cfg.model.vocab,
        micro_batch_size=cfg.train.micro_batch_size,
        microbatches=cfg.train.micro_batches,
        seed=cfg.train.seed,
    )


def _check_fail(cfg: DemoConfig) -> None:
    """fail.kill_stage names a stage; fail.kill_at an iteration after the first one (which records)."""
    fail = cfg.fail
    if fail.kill_stage is None:
        if fail.kill_at is not None:
            raise ConfigError("fail.kill_at needs fail.kill_stage (the stage to kill), e.g. fail.kill_stage=0")
        return
    if not 0 <= fail.kill_stage < cfg.parallel.pp:
        raise ConfigError(
            f"fail.kill_stage must be a pipeline stage, 0 to {cfg.parallel.pp - 1}; got {fail.kill_stage}"
        )
    if cfg.train.iters < 2:
        raise ConfigError("fail.kill_stage needs train.iters >= 2: the run records an iteration before the kill")
    if fail.kill_at is None:
        fail.kill_at = cfg.train.iters // 2 + 1
    if not 2 <= fail.kill_at <= cfg.train.iters:
        raise ConfigError(f"fail.kill_at must be between 2 and train.iters ({cfg.train.iters}); got {fail.kill_at}")


# ---- the run folder: one per run, never shared -------------------------------------------

#: The failure demo's launcher log in the run folder: the ranks' and torchrun's output.
LAUNCH_LOG = "torchrun.log"
#: Stands for the run's folder name until claim_run_dir has chosen it.
PENDING_NAME = "demo-<date>-<time>"


def claim_run_dir(run: RunConfig) -> str:
    """Choose and create this run's folder; its name. Called once per job, before any rank writes.

    No run.name: a new ``demo-<date>-<time>`` (``-2``, ``-3``... when one exists). A given
    run.name whose folder holds anything is refused with ConfigError, unless run.overwrite,
    which deletes it first: two runs in one folder would show as one series in TensorBoard
    and in ``nemo-memlog report``. An existing empty folder is taken (the launcher claims it
    for the ranks it starts, and the failure demo's launcher may have opened its LAUNCH_LOG there)."""
    root = Path(run.root)
    if run.name is None:
        stamp = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
        for suffix in ["", *(f"-{i}" for i in range(2, 1000))]:
            try:
                (root / (stamp + suffix)).mkdir(parents=True)  # atomic: two launches never share one
                return stamp + suffix
            except FileExistsError:
                continue
        raise ConfigError(f"no free run folder {root / stamp}-N: give run.name")
    folder = root / run.name
    if folder.is_dir() and any(entry.name != LAUNCH_LOG for entry in folder.iterdir()):
        if not run.overwrite:
            raise ConfigError(
                f"run.name={run.name}: {folder} already holds a run, and runs never share a folder. "
                f"Leave run.name out for a new demo-<date>-<time> folder, choose another run.name, "
                f"or add run.overwrite=true to delete {folder} and start again"
            )
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return run.name


def relaunch(overrides: list[str], nproc: int, log: Path | None = None) -> int:
    """Run this script under torchrun with ``nproc`` local processes; its exit code.
    ``log``: the ranks' and torchrun's output goes there instead of the terminal."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(free_port()),
        __file__,
        *overrides,
    ]
    try:
        # torchrun's and W&B's temporary folders go in one of the job's own, removed at the end.
        with private_tmpdir(prefix="nemo_memlog-demo-tmp-") as tmp:
            env["TMPDIR"] = str(tmp)
            if log is None:
                # A line every few seconds until rank 0 takes over saying what starts (4 processes
                # importing torch on 2 cores: 10 s and more before it can).
                started = Path(tmp) / "started"
                env[STARTED_ENV] = str(started)
                with ticking(f"demo.py: torchrun starts {nproc} processes", until=started.exists):
                    return subprocess.call(command, env=env)
            with open(log, "w") as out, ticking(f"demo.py: the job runs (its output: {log})"):
                return subprocess.call(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    except KeyboardInterrupt:  # torchrun got the same Ctrl-C and stops the ranks
        return 130


def train(cfg: DemoConfig, argv: list[str]) -> int:
    """One torchrun process: join the pipeline, train, log every iteration, report at the end.
    Its exit code: 2 when rank 0 could not claim the run folder."""
    talks = os.environ.get("RANK", "0") == "0"  # rank 0 says what starts, on stderr (stdout is the job's)
    if talks and os.environ.get(STARTED_ENV):
        Path(os.environ[STARTED_ENV]).touch()  # the launcher's ticker stops: this one takes over
    world = os.environ.get("WORLD_SIZE", "1")
    # Imported here, not at the top: the launching process has no use for its ~7 s import.
    with starting(talks, f"demo.py: importing megatron-core in {world} processes"):
        quiet_megatron()
        from megatron.core import parallel_state as ps

    torch.set_num_threads(1)
    device = stage_device()
    backend = "nccl" if device.type == "cuda" else "gloo"
    with starting(talks, f"demo.py: joining the process group ({backend}, {world} processes)"):
        dist.init_process_group(backend)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        cfg = _with_claimed_run_dir(cfg, argv)
    if cfg is None:
        dist.destroy_process_group()
        return 2
    if device.type == "cpu" and dist.get_rank() == 0:
        print(f"demo.py: {megatron_cpu.summary()}", flush=True)
    building = f"demo.py: building megatron-core's GPTModel, PP {cfg.parallel.pp}, in its DDP with its Adam"
    with starting(talks, building):
        job = build_job(job_spec(cfg), device)  # Megatron's groups, model, DDP, optimizer and schedule
        dist.barrier()  # every rank joins the default group before the first pairwise send (NCCL)
    last_logged = _train_loop(cfg, job, ps, talks)
    # Every rank: the writer rank's backends are flushed before the paths below are printed,
    # and every rank's flight record ends "close" (a clean end) rather than "exit".
    nemo_memlog.close_writers()
    if dist.get_rank() == dist.get_world_size() - 1:  # nemo_memlog's writer rank
        print(summary(cfg, last_logged), flush=True)
    dist.destroy_process_group()
    return 0


def starting(talks: bool, what: str) -> contextlib.AbstractContextManager:
    """What rank 0 says of a step of the start: the step, then a line every few seconds while it lasts."""
    return ticking(what) if talks else contextlib.nullcontext()


def _with_claimed_run_dir(cfg: DemoConfig, argv: list[str]) -> DemoConfig | None:
    """Rank 0 claims the run folder and every rank takes its name (under a torchrun the user
    started, each rank would otherwise stamp its own); None on every rank if it was refused."""
    outcome = [None]
    if dist.get_rank() == 0:
        try:
            outcome = [("name", claim_run_dir(cfg.run))]
        except ConfigError as error:
            print(f"demo.py: {error}", file=sys.stderr, flush=True)
            outcome = [("refused", str(error))]
    dist.broadcast_object_list(outcome, src=0)
    kind, value = outcome[0]
    if kind == "refused":
        return None
    return load_config([*argv, f"run.name={value}"])


#: megatron-core's notes that say nothing about this run, repeated by every rank: what it falls back
#: to without Transformer Engine and Apex, GPTModel's pointer to its successor, experimental classes
#: it imports, and a deprecated default of its TransformerConfig.
MEGATRON_NOISE = (
    "Transformer Engine and Apex",
    "Apex is not installed",
    "full scope is deprecated",
    "MimoModelConfig is experimental",
)


def quiet_megatron() -> None:
    for message in MEGATRON_NOISE:
        warnings.filterwarnings("ignore", message=message)
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)  # "GPTModel IS DEPRECATED"


def stage_device() -> torch.device:
    """This process's GPU when the node has one per process; else the CPU, with a one-line note
    (rank 0). NCCL refuses two ranks on one GPU, so fewer GPUs than processes means CPU."""
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0  # creates no CUDA context
    if gpus >= processes:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if gpus and os.environ.get("RANK", "0") == "0":
        print(
            f"demo.py: {processes} processes on this node but {gpus} GPU(s): the stages run on CPU (gloo).",
            file=sys.stderr,
            flush=True,
        )
    return torch.device("cpu")


def _train_loop(cfg: DemoConfig, job: DemoJob, ps, talks: bool = False):
    """The iterations; training_log on every rank each one. (iteration, dict) it last returned, or None."""
    writer = dist.get_rank() == dist.get_world_size() - 1  # a last stage: it has the loss to show
    if writer:
        (Path(cfg.run.root) / cfg.run.name).mkdir(parents=True, exist_ok=True)

    t = cfg.train
    stage, stages = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    dp_group, dp_size = ps.get_data_parallel_group(), ps.get_data_parallel_world_size()
    schedule = f"interleaved, VPP {cfg.parallel.vpp}" if cfg.parallel.vpp else "1F1B"
    last_logged = None
    # What nemo-memlog advise needs to know of the run (docs/advise.md)
    facts = job.spec.facts()
    # Rank 0's lines during the first iteration, until the bar starts (closed there, or on the way out).
    with contextlib.ExitStack() as first:
        first.enter_context(starting(talks, "demo.py: iteration 1, the first logging step (the bar starts after it)"))
        for iteration in range(1, t.iters + 1):
            if iteration == cfg.fail.kill_at and stage == cfg.fail.kill_stage and job.dp_rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer: no end, no goodbye
            lr = learning_rate(iteration, t.iters, t.lr)
            job.set_lr(lr)
            loss = job.train_iteration()  # Megatron's schedule, DDP grad sync and optimizer step
            if loss is not None and dp_size > 1:  # the last stages: the loss over the data-parallel replicas
                total = torch.tensor([loss], device=job.device)
                dist.all_reduce(total, group=dp_group)
                loss = float(total) / dp_size
            if t.save_every and iteration % t.save_every == 0:
                save_checkpoint(cfg, job, stage, iteration)
            metrics = {"lr": lr} if loss is None else {"lr": lr, "loss": loss}  # only last stages have a loss
            logged = nemo_memlog.training_log(
                iteration, cfg, metrics=metrics, model=job.model, optimizer=job.optimizer, facts=facts
            )
            if logged is not None:
                last_logged = (iteration, logged)
            if iteration == 1:
                # Rank 0 says where the flight records are during the first logging step: the bar
                # starts after that line is out, so that it is not drawn into the middle of the bar.
                dist.barrier()
                first.close()
                progress = tqdm(
                    total=t.iters,
                    initial=1,
                    desc=f"training ({dist.get_world_size()} processes, PP {stages}, {schedule})",
                    unit="it",
                    disable=not writer,
                )
            else:
                progress.update(1)
            if loss is not None:
                progress.set_postfix(loss=f"{loss:.3f}")
    progress.close()
    return last_logged


def save_checkpoint(cfg: DemoConfig, job: DemoJob, stage: int, iteration: int) -> None:
    """This rank's model chunks and optimizer state into the run folder, inside a memory phase: its
    host peak is logged as memory/phase/checkpoint_save/* at this iteration's logging step."""
    folder = Path(cfg.run.root) / cfg.run.name / "checkpoints" / f"iter-{iteration:05d}"
    folder.mkdir(parents=True, exist_ok=True)
    with nemo_memlog.memory_phase("checkpoint_save", iteration=iteration):
        torch.save(job.state_dict(), folder / f"stage-{stage}-dp-{job.dp_rank}.pt")


def summary(cfg: DemoConfig, last_logged) -> str:
    """The closing report: per-stage peaks vs the logged pipeline peak, and the dashboards."""
    lines = [""]
    if last_logged is None:
        lines.append(
            "No memory was logged: turn on logger.log_memory_to_tensorboard, or make train.iters "
            ">= logger.tensorboard_log_interval."
        )
    else:
        iteration, logged = last_logged
        for name, label in TABLES:
            if f"memory/{name}" in logged:
                lines += _stage_table(cfg, iteration, logged, name, label)
    run_dir = Path(cfg.run.root) / cfg.run.name
    lines += [
        "",
        f"This run's folder: {run_dir} (a new one for every run; run.name=... chooses it)",
        "Per-stage table and PNG of this run:",
        f"  {report_command(run_dir)}",
    ]
    records = nemo_memlog.config.resolve(cfg.logger).record_dir
    if records:
        lines += [
            "After a failure, which rank failed first and what every rank held (the flight records):",
            f"  {postmortem_command(records)}",
        ]
    local, account = dashboard_commands(cfg.logger)
    if local:
        lines += ["Open the dashboards (no account needed):"] + [f"  {command}" for command in local]
    if account:
        lines += [
            "W&B and Comet wrote offline copies; uploading them needs an account "
            "(`wandb login` first; COMET_API_KEY set):"
        ] + [f"  {command}" for command in account]
        lines.append(
            "  without an account, the same series are in the TensorBoard and MLflow dashboards above"
            if local
            else "  without an account, nemo-memlog report above shows the memory series"
        )
    return "\n".join(lines)


#: (logged name, label) of the closing tables: host RSS always; CUDA memory when a GPU was used.
TABLES = (("peak_host_rss_gb", "peak host RSS"), ("peak_allocated_gb", "peak CUDA allocated"))


def _stage_table(cfg: DemoConfig, iteration: int, logged: dict, name: str, label: str) -> list[str]:
    stages = sorted(
        int(key.split("/")[1].removeprefix("pp_stage_"))
        for key in logged
        if key.startswith("memory/pp_stage_") and key.endswith("/" + name)
    )
    peak, peak_stage = logged[f"memory/{name}"], logged[f"memory/peak_stage/{name}"]
    window = " (since the previous logging step)" if cfg.logger.memory_peak_window == "interval" else ""
    lines = [
        f"{label[0].upper() + label[1:]} per pipeline stage at iteration {iteration}{window} "
        f"(memory/pp_stage_{{i}}/{name}):",
        f"  stage   microbatches in flight   activations (measured)   {label}",
    ]
    last = len(stages) - 1
    for stage in stages:
        in_flight = logged.get(f"memory/pp_stage_{stage}/microbatches_in_flight", "-")
        activations = logged.get(f"memory/pp_stage_{stage}/activations_gb")
        held = "-" if activations is None else f"{activations:.3f} GB"
        notes = []
        if stage == peak_stage:
            notes.append("<- pipeline peak")
        if stage == last and cfg.logger.writer_mode == "thread":
            notes.append("(also runs the logging backends)")
        lines.append(
            f"  {stage:>5}   {in_flight:>22}   {held:>22}   {logged[f'memory/pp_stage_{stage}/{name}']:>10.3f} GB  "
            + " ".join(notes)
        )
    lines.append(f"  logged: memory/{name} = {peak:.3f} GB, memory/peak_stage/{name} = {peak_stage}")
    if last > 0:
        first_minus_last = logged[f"memory/pp_stage_0/{name}"] - logged[f"memory/pp_stage_{last}/{name}"]
        lines.append(f"  stage 0 - stage {last}: {1000 * first_minus_last:+.0f} MB")
    return lines


def dashboard_commands(logger) -> tuple[list[str], list[str]]:
    """How to open what each enabled backend wrote (call after the writers are closed): the
    commands that work offline, and the uploads that need an account."""
    local, account = [], []
    if logger.tensorboard_dir:
        local.append(f"{console_command('tensorboard')} --logdir {logger.tensorboard_dir}")
    if logger.mlflow_experiment:
        local.append(f"{console_command('mlflow')} ui --backend-store-uri {logger.mlflow_tracking_uri}")
    if logger.wandb_project and os.environ.get("WANDB_MODE") == "offline":
        found = _newest(Path(logger.wandb_save_dir or ".") / "wandb", "offline-run-*")
        account.append(
            f"{console_command('wandb')} sync {found or Path(logger.wandb_save_dir or '.') / 'wandb' / 'offline-run-*'}"
        )
    if logger.comet_project and logger.comet_offline_directory:
        found = _newest(Path(logger.comet_offline_directory), "*.zip")
        account.append(f"{console_command('comet')} upload {found or Path(logger.comet_offline_directory) / '*.zip'}")
    if getattr(logger, "otel_metrics", False):  # logger.otel_metrics=true, with the OTEL_* variables
        from nemo_memlog.writers.otel import destination

        local.append(f"OpenTelemetry metrics (docs/writers.md): {destination(dict(os.environ))}")
    return local, account


def _newest(folder: Path, pattern: str) -> Path | None:
    matches = sorted(folder.glob(pattern), key=lambda path: path.stat().st_mtime)
    return matches[-1] if matches else None


def failure_demo(cfg: DemoConfig, name: str, argv: list[str]) -> int:
    """Launch the job that loses a stage, then say what happened and print the post-mortem command.
    0 when the rank died as planned; 1 when the job ended without the failure."""
    cfg = load_config([*argv, f"run.name={name}"])
    run_dir = Path(cfg.run.root) / name
    log = run_dir / LAUNCH_LOG
    fail = cfg.fail
    print(
        f"demo.py: training until pipeline stage {fail.kill_stage}'s first rank SIGKILLs itself at iteration "
        f"{fail.kill_at} of {cfg.train.iters} (the ranks' output: {log}) ...",
        flush=True,
    )
    code = relaunch([*argv, f"run.name={name}"], processes(cfg), log=log)
    records = nemo_memlog.config.resolve(cfg.logger).record_dir
    if code == 0 or not Path(records).is_dir():
        print(f"demo.py: the job did not fail as planned (torchrun's exit code {code}; see {log})", file=sys.stderr)
        return 1
    print(
        "\n".join(
            [
                f"demo.py: the job failed as planned (torchrun's exit code {code}): stage {fail.kill_stage}'s first "
                "rank was SIGKILLed, as the kernel's OOM killer does, and the others lost their peer.",
                "Which rank failed first, and what every rank held (its flight records):",
                f"  {postmortem_command(records)}",
                "The memory series up to the failure:",
                f"  {report_command(run_dir)}",
            ]
        ),
        flush=True,
    )
    return 0


def help_text() -> str:
    """The module docstring, then every key of every section with its default (and its doc)."""
    lines = [__doc__.rstrip(), "", "Keys (section.key=default):"]
    for section, schema in SECTIONS.items():
        lines += _key_lines(section, schema(), _field_docs(schema))
    lines += ["", "logger (nemo_memlog.LoggerConfig; the demo's defaults, every backend writing into the run folder):"]
    lines += _key_lines("logger", logger_defaults(RunConfig()), _field_docs(nemo_memlog.LoggerConfig))
    return "\n".join(lines)


def _key_lines(section: str, defaults, docs: dict[str, str]) -> list[str]:
    lines = []
    for spec in dataclasses.fields(defaults):
        value = getattr(defaults, spec.name)
        shown = json.dumps(value) if isinstance(value, (bool, type(None), list, dict)) else value
        if section == "run" and spec.name == "name":
            shown = PENDING_NAME
        doc = docs.get(spec.name, "")
        lines.append(f"  {f'{section}.{spec.name}={shown}':<40}  {doc}".rstrip())
    return lines


def _field_docs(schema) -> dict[str, str]:
    """Field name -> first sentence of the docstring under it in the class's source."""
    try:
        body = ast.parse(inspect.getsource(schema)).body[0].body
    except (OSError, TypeError):
        return {}
    docs = {}
    for field_node, doc_node in zip(body, body[1:]):
        if (
            isinstance(field_node, ast.AnnAssign)
            and isinstance(field_node.target, ast.Name)
            and isinstance(doc_node, ast.Expr)
            and isinstance(doc_node.value, ast.Constant)
            and isinstance(doc_node.value.value, str)
        ):
            text = " ".join(doc_node.value.value.split())
            docs[field_node.target.id] = re.split(r"(?<!e\.g)\. ", text)[0].rstrip(".")
    return docs


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print(help_text())
        return 0
    os.environ.setdefault("WANDB_MODE", "offline")  # no account: an offline run to `wandb sync` later
    os.environ.setdefault("WANDB_SILENT", "true")  # its run summary would bury the table below
    # The backends' INFO lines (MLflow creating its tables, Comet archiving) would break into
    # the progress bar; the closing lines say where everything is. Warnings still show.
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("COMET_LOGGING_CONSOLE", "WARNING")
    try:
        cfg = load_config(argv)
        if "RANK" not in os.environ:  # claimed here, so that a refusal comes before any process starts
            name = claim_run_dir(cfg.run)
            if cfg.fail.kill_stage is not None:
                return failure_demo(cfg, name, argv)
            return relaunch([*argv, f"run.name={name}"], processes(cfg))
    except ConfigError as error:
        print(f"demo.py: {error}", file=sys.stderr)
        return 2
    return train(cfg, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
