"""A real megatron-core job inside Megatron-Bridge's training loop (bridge_harness's
``RunSpec(megatron=JobSpec(...))``): Bridge's own ``train_step`` over megatron_cpu's GPTModel in
Megatron's DDP, and what such a run left on a rank."""

from __future__ import annotations

import os


def view(root: str, job, record) -> dict:
    """What a megatron run left on this rank: its per-layer record (the callback wrote it in the
    default folder, ``memory_records`` beside the recipe's tensorboard_dir), the model state counted
    apart from Megatron's buffers and Adam's rule, and the losses Bridge's train_step reduced."""
    from megatron.core import parallel_state as ps

    from nemo_memlog.measure import layer_record

    from .megatron import cpu as megatron_cpu

    return {
        "pp_rank": record.pp_stage,
        "dp_rank": record.dp_rank,
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "layers": layer_record.read_rank(os.path.join(root, "memory_records"), record.rank),
        "apart": megatron_cpu.counted_apart(job),
        "losses": [s.loss for s in record.steps],
    }


class BridgeTrainStep:
    """Bridge's own ``train_step`` (megatron.bridge.training.train) over a megatron_cpu job: Megatron's
    schedule (``get_forward_backward_func()``, 1F1B) over ``get_num_microbatches()`` microbatches of
    the job's synthetic batch, the forward step wrapped by Bridge's ``prepare_forward_step_func``, the
    optimizer step, Bridge's reductions of the step's success and grad norm over the model-parallel
    group, the scheduler step, and its loss reduction on the last stage. It runs inside megatron_cpu's
    stand-ins (Megatron's schedule and optimizer) and bridge_env's redirects (Bridge's train_utils and
    megatron-core's timers). Arguments as Bridge's ``train()`` passes them, for the installed version:
    0.6 takes the ``P2PCommunicator`` that ``train()`` builds once; 0.3 builds its own in the step.

    The forward step is the harness's (megatron_cpu.forward_step), not Bridge's ``gpt_step.forward_step``:
    its ``get_batch_from_iterator`` moves every tensor with ``.cuda(non_blocking=True)``, which a
    CPU-only torch cannot do."""

    def __init__(self, job, state):
        import inspect

        from megatron.bridge.training import train as bridge_train
        from megatron.bridge.training.utils.pg_utils import get_pg_collection
        from megatron.bridge.training.utils.train_utils import prepare_forward_step_func
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.utils import get_model_config

        from .megatron import cpu as megatron_cpu

        self.job, self.state, self.train_step = job, state, bridge_train.train_step
        self.forward_step = prepare_forward_step_func(megatron_cpu.forward_step, state)
        self.pg_collection = get_pg_collection(job.model)  # as Bridge's setup reads it from the model
        lr = job.optimizer.param_groups[0]["lr"]
        with megatron_cpu.cpu_stand_ins():
            self.scheduler = OptimizerParamScheduler(
                job.optimizer,
                init_lr=0.0,
                max_lr=lr,
                min_lr=0.0,
                lr_warmup_steps=0,
                lr_decay_steps=1000,
                lr_decay_style="constant",
                start_wd=0.0,
                end_wd=0.0,
                wd_incr_steps=1000,
                wd_incr_style="constant",
            )
        model_config = get_model_config(job.model[0])
        if not hasattr(model_config, "seq_length"):
            # Bridge's models carry their provider (a TransformerConfig with seq_length) as their config;
            # 0.3's train_step reads model_config.seq_length, 0.6's falls back to cfg.model.seq_length.
            model_config.seq_length = state.cfg.model.seq_length
        self.extra = []
        if "p2p_communicator" in inspect.signature(bridge_train.train_step).parameters:  # 0.4+
            from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

            self.extra.append(P2PCommunicator(pp_group=self.pg_collection.pp, config=model_config))

    def __call__(self):
        """One iteration: (loss_dict, skipped_iter, grad_norm, num_zeros_in_grad), as bridge_harness's own step."""
        from .megatron import cpu as megatron_cpu

        job = self.job
        with megatron_cpu.cpu_stand_ins():
            loss_dict, skipped_iter, _, should_exit, _, grad_norm, num_zeros, *_ = self.train_step(
                self.forward_step,
                job.data(0),
                job.model,
                job.optimizer,
                self.scheduler,
                self.state,
                self.pg_collection,
                job.forward_backward,
                *self.extra,
            )
        assert not should_exit, "Bridge's rerun state machine asked to exit"
        job.iteration += 1
        return loss_dict, skipped_iter, grad_norm, num_zeros
