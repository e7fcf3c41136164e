"""Functions the gloo cluster runs on each rank (``Cluster.run``), shared by test modules: a spawned
rank imports them by this module's name."""

import warnings

from nemo_memlog import LoggerConfig, training_log


def skip_or_log(skipping_rank, timeout_s, **config):
    import torch.distributed as dist

    cfg = LoggerConfig(log_memory_to_tensorboard=True, memory_reduce_timeout_s=timeout_s, **config)
    if dist.get_rank() == skipping_rank:
        return "skipped"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return training_log(7, cfg)
