"""A real-Megatron training job as a command line, for ``nemo-memlog fit`` and its tests: every rank
builds megatron_cpu's job (GPTModel in Megatron's DDP, its Adam and schedule) and calls
``nemo_memlog.training_log`` after each iteration, as a user's own loop does. It needs torchrun (one
process per rank, over gloo): ``python -m torch.distributed.run --nproc-per-node 2 -m ...``.

    python -m torch.distributed.run --nproc-per-node 2 -m nemo_memlog.testing.megatron.job \\
        --micro-batch-size {micro_batch_size} --global-batch 16 --iters 1000 --out DIR

``--global-batch`` is the samples per iteration over the data-parallel replicas: the microbatches per
rank are global / (micro-batch size x DP), refused (exit 2) when that is not whole. The job states
its facts (``JobSpec.facts``). Rank 0 prints one line per iteration; the job ends after ``--iters``.
"""

from __future__ import annotations

import argparse
import os
import sys

from .cpu import JobSpec, build


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron_job", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (the rest of the world: DP)")
    parser.add_argument("--vpp", type=int, default=None, help="model chunks per stage: the interleaved schedule")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, required=True)
    parser.add_argument("--global-batch", type=int, default=16, help="samples per iteration, all replicas")
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--interval", type=int, default=1, help="the logging interval (tensorboard_log_interval)")
    parser.add_argument("--recompute", choices=("full",), default=None)
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--out", required=True, help="folder for the job's TensorBoard events and records")
    return parser


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    import nemo_memlog

    args = _parser().parse_args(argv)
    dist.init_process_group("gloo")
    dp = dist.get_world_size() // args.pp
    microbatches, rest = divmod(args.global_batch, args.micro_batch_size * dp)
    if rest or microbatches < 1:
        if dist.get_rank() == 0:
            print(
                f"megatron_job: --global-batch {args.global_batch} is not a whole number of microbatches of "
                f"{args.micro_batch_size} on each of DP {dp} replicas",
                file=sys.stderr,
            )
        dist.destroy_process_group()
        return 2
    spec = JobSpec(
        pp=args.pp,
        vpp=args.vpp,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        seq=args.seq,
        vocab=args.vocab,
        micro_batch_size=args.micro_batch_size,
        microbatches=microbatches,
        recompute=args.recompute,
        distributed_optimizer=args.distributed_optimizer,
    )
    job = build(spec)
    logger = nemo_memlog.LoggerConfig(
        log_memory_to_tensorboard=True,
        tensorboard_log_interval=args.interval,
        tensorboard_dir=os.path.join(args.out, "tb"),
    )
    for iteration in range(1, args.iters + 1):
        loss = job.train_iteration()
        nemo_memlog.training_log(iteration, logger, model=job.model, optimizer=job.optimizer, facts=spec.facts())
        if dist.get_rank() == 0:
            print(f"iteration {iteration} micro_batch_size {spec.micro_batch_size} loss {loss}", flush=True)
    nemo_memlog.close_writers()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
