"""A GPT pretraining script of the project's own, trained by Megatron-LM's own loop
(``megatron.training.pretrain``: ``train`` -> ``train_step`` -> ``training_log``), on CPU under
torchrun. It needs torchrun (one process per rank) and takes Megatron-LM's own flags:

    python -m torch.distributed.run --nproc-per-node 2 -m nemo_memlog.testing.megatron.lm_job \\
        --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 64 --num-attention-heads 4 \\
        --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 \\
        --train-iters 4 --lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 255 \\
        --eval-interval 100 --tensorboard-dir DIR --log-memory-to-tensorboard \\
        --distributed-backend gloo --transformer-impl local --no-persist-layer-norm \\
        --no-gradient-accumulation-fusion [--nemo-memlog]

Its own pieces, as a user's pretrain script has them: a model provider (megatron-core's
``GPTModel`` on the local layer spec), a forward step with its loss, and the data provider over
Megatron's ``MockGPTDataset``. ``--nemo-memlog`` calls ``nemo_memlog.megatron_lm.install()``
before ``pretrain``, as a user's script does; without it the script is Megatron-LM alone (or
instrumented from outside, by ``nemo-memlog run``). On a CPU-only machine the stand-ins of
megatron_lm_stand_ins are installed first (under ``nemo-memlog run --cpu``, by its switch instead).
NVIDIA's ModelOpt is hidden (``hide_modelopt``), as in megatron-core's own ``training`` extra.
"""

from __future__ import annotations

import sys
from functools import partial

USAGE_NOTE = "(needs torchrun: one process per rank; run with --help for Megatron-LM's flags)"


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """megatron-core's GPTModel on the local layer spec, as Megatron-LM's args describe it."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    config = config or core_transformer_config_from_args(args)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


def _batch(data_iterator, vp_stage):
    """This stage's microbatch: tokens and position ids on the first stage, labels and the loss
    mask on the last (a middle stage reads nothing)."""
    from megatron.training.utils import is_first_or_last_pipeline_stage

    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    batch = next(data_iterator)
    names = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
    return tuple(batch[name].cuda(non_blocking=True) for name in names)  # on CPU: the stand-in keeps them there


def loss_func(loss_mask, output_tensor):
    """The summed loss over unmasked tokens, their count, and ``lm loss`` for Megatron-LM's log."""
    import torch

    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), tokens.view(1)])}


def forward_step(data_iterator, model):
    """One microbatch forward: Megatron-LM's forward_step_func contract."""
    from megatron.core.utils import get_attr_wrapped_model

    tokens, labels, loss_mask, attention_mask, position_ids = _batch(
        data_iterator, get_attr_wrapped_model(model, "vp_stage")
    )
    output = model(tokens, position_ids, attention_mask, labels=labels)
    return output, partial(loss_func, loss_mask)


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's MockGPTDataset for train, validation and test, built on the first and last stages."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        split=args.split,
        tokenizer=build_tokenizer(args),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=True,
    )
    return BlendedMegatronDatasetBuilder(
        MockGPTDataset, train_val_test_num_samples, lambda: is_first_or_last_pipeline_stage(vp_stage), config
    ).build()


def _own_flags(parser):
    group = parser.add_argument_group("megatron_lm_job")
    group.add_argument("--nemo-memlog", action="store_true", help="nemo_memlog.megatron_lm.install() before pretrain")
    group.add_argument(
        "--reload-loop",
        action="store_true",
        help="with --nemo-memlog: importlib.reload(megatron.training.training) after install(), then install() "
        "again (it says so and wraps the reloaded loop)",
    )
    group.add_argument(
        "--count-apart",
        default=None,
        metavar="DIR",
        help="write DIR/rank-<r>.json: the activations autograd saved in each iteration (megatron_cpu's "
        "SavedTensorCount around train_step), Megatron's own in-flight count, and the losses",
    )
    group.add_argument(
        "--device-stats",
        default=None,
        metavar="DIR",
        help="write DIR/stats-<r>.json: this rank's torch.cuda.memory_stats() right after each training_log "
        "(a GPU check of the mem-* series, read apart from nemo_memlog)",
    )
    group.add_argument(
        "--iteration-times",
        default=None,
        metavar="DIR",
        help="write DIR/times-<r>.json: each iteration's wall seconds, from train_step's start to the end of "
        "its training_log (the benchmark's Megatron-LM part)",
    )
    return parser


def iteration_times(folder: str) -> None:
    """Wrap Megatron-LM's ``train_step`` and ``training_log`` (outermost) to time each iteration, from the
    step's start to its log's end, into ``folder/times-<r>.json`` (``{iteration: seconds}``)."""
    import json
    import os
    import time

    import megatron.training.training as training
    import torch.distributed as dist

    step, log = training.train_step, training.training_log
    started: dict = {}
    times: dict = {}

    def train_step(*args, **kwargs):
        started["at"] = time.perf_counter()
        return step(*args, **kwargs)

    def training_log(*args, **kwargs):
        result = log(*args, **kwargs)
        iteration = args[3] if len(args) > 3 else kwargs["iteration"]
        times[str(iteration)] = time.perf_counter() - started["at"]
        if len(times) % 10 == 0 or iteration >= training.get_args().train_iters:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"times-{dist.get_rank()}.json"), "w") as out:
                json.dump(times, out)
        return result

    training.train_step, training.training_log = train_step, training_log


def device_stats(folder: str) -> None:
    """Wrap Megatron-LM's ``training_log`` (outermost, after nemo_memlog's own wrapper) to keep this rank's
    ``torch.cuda.memory_stats()`` keys that Megatron-LM's ``mem-*`` scalars read, per iteration."""
    import json
    import os

    import megatron.training.training as training
    import torch
    import torch.distributed as dist

    from .lm_stand_ins import MEGATRON_LM_MEMORY_KEYS

    original = training.training_log
    seen: dict = {}

    def training_log(*args, **kwargs):
        result = original(*args, **kwargs)
        iteration = args[3] if len(args) > 3 else kwargs["iteration"]
        stats = torch.cuda.memory_stats()
        seen[str(iteration)] = {key: stats.get(key) for key in MEGATRON_LM_MEMORY_KEYS}
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"stats-{dist.get_rank()}.json"), "w") as out:
            json.dump(seen, out)
        return result

    training.training_log = training_log


def count_apart(folder: str) -> None:
    """Wrap Megatron-LM's ``train_step`` (looked up at call time, as nemo_memlog's own wrapper is)
    in a count made apart from nemo_memlog: every tensor autograd saves during the step, outermost,
    so nemo_memlog's meter nests inside it. After each step this rank's figures go to
    ``folder/rank-<r>.json``: ``saved_peak_bytes`` per iteration, ``expected_in_flight`` from Megatron's
    own warm-up count, and the stage's coordinates."""
    import json
    import os

    import megatron.training.training as training
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel import schedules
    from megatron.training import get_args

    from .cpu import SavedTensorCount

    original = training.train_step
    figures: dict = {"saved_peak_bytes": {}}

    def train_step(forward_step_func, data_iterator, model, *args, iteration=None, **kwargs):
        count = SavedTensorCount(model)
        with count():
            result = original(forward_step_func, data_iterator, model, *args, iteration=iteration, **kwargs)
        megatron_args = get_args()
        pp, vpp = megatron_args.pipeline_model_parallel_size, megatron_args.virtual_pipeline_model_parallel_size
        group = getattr(megatron_args, "microbatch_group_size_per_vp_stage", None) or pp  # the config's default
        total, all_warmup, warmup = schedules.get_pp_rank_microbatches(
            get_num_microbatches(), vpp or 1, group if vpp else 1
        )[:3]
        figures.update(
            rank=dist.get_rank(),
            pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
            expected_in_flight=total if all_warmup else warmup + 1,
        )
        figures["saved_peak_bytes"][str((iteration or 0) + 1)] = count.peak_bytes
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank-{dist.get_rank()}.json"), "w") as out:
            json.dump(figures, out)
        return result

    training.train_step = train_step


def hide_modelopt() -> None:
    """Megatron-LM as megatron-core's ``training`` (or ``mlm``) extra installs it: without NVIDIA's
    ModelOpt, which only its ``dev`` extra brings. Megatron-LM's training and checkpointing modules
    import ModelOpt when it is there (about 4 CPU-seconds per rank here, for nothing this job uses);
    this project's environment has it for Megatron-Bridge, whose training loop imports it."""
    sys.modules.setdefault("modelopt", None)  # None: ``import modelopt`` raises ImportError


def main(argv: list[str]) -> int:
    import os

    if "--help" not in argv and "-h" not in argv and "LOCAL_RANK" not in os.environ:
        print(f"megatron_lm_job: {USAGE_NOTE}", file=sys.stderr)
        return 2
    hide_modelopt()
    from . import lm_stand_ins as megatron_lm_stand_ins

    if os.environ.get("NEMO_MEMLOG_CPU_STAND_INS", "").strip().lower() not in ("1", "true", "yes", "on"):
        megatron_lm_stand_ins.install()  # else `nemo-memlog run --cpu` installs them as Megatron-LM's loop loads
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    sys.argv = [sys.argv[0], *argv]
    datasets_provider.is_distributed = True  # every rank builds its own (Megatron-LM's convention)
    args = parse_and_validate_args(extra_args_provider=_own_flags)
    if args.nemo_memlog:
        from nemo_memlog import megatron_lm

        megatron_lm.install()
        if args.reload_loop:
            import importlib

            import megatron.training.training as loop

            stand_ins = {name: getattr(loop, name) for name in ("torch", "initialize_megatron")}
            importlib.reload(loop)
            vars(loop).update(stand_ins)  # the CPU stand-ins as they were (a reload undoes them; a no-op on CUDA)
            megatron_lm.install()
    if args.count_apart:
        count_apart(args.count_apart)
    if args.device_stats:
        device_stats(args.device_stats)
    if args.iteration_times:
        iteration_times(args.iteration_times)
    import warnings

    with warnings.catch_warnings():  # "use a ModelConfig instead of a model provider": ours is one on purpose
        warnings.simplefilter("ignore", UserWarning)
        config = pretrain_cfg_container_from_args(args)
    pretrain(config, datasets_provider, ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
