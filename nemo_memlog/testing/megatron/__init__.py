"""Megatron on a CPU-only machine, for the tests and scripts: megatron-core's own training stack and
Megatron-LM's own loop, over gloo.

    stand_ins      what stands in for megatron-core's GPU assumptions, each with its reason
    cpu            megatron-core's GPTModel in Megatron's DDP, its optimizer and schedules, on CPU
    lm_stand_ins   what stands in for the GPU assumptions of Megatron-LM's loop (``nemo-memlog run --cpu``)
    job            a megatron-core training job as a command line (``python -m nemo_memlog.testing.megatron.job``)
    lm_job         a GPT pretraining script of our own, trained by Megatron-LM's own loop
"""
