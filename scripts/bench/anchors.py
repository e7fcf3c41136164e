"""The field's reductions and statistics reads, as their projects write them (the device aside:
gloo needs CPU tensors): what the benchmark puts nemo_memlog's logging step beside."""

from __future__ import annotations

import torch
import torch.distributed as dist

#: Megatron-Bridge 0.3.1's default memory_keys (training/utils/train_utils.py).
BRIDGE_MEMORY_KEYS = {
    "allocated_bytes.all.current": "mem-allocated-bytes",
    "active_bytes.all.current": "mem-active-bytes",
    "inactive_split_bytes.all.current": "mem-inactive-bytes",
    "reserved_bytes.all.current": "mem-reserved-bytes",
    "allocated_bytes.all.peak": "mem-max-allocated-bytes",
    "active_bytes.all.peak": "mem-max-active-bytes",
    "inactive_split_bytes.all.peak": "mem-max-inactive-bytes",
    "reserved_bytes.all.peak": "mem-max-reserved-bytes",
    "num_alloc_retries": "mem-alloc-retires",
    "allocation.all.current": "mem-allocated-count",
}


def bridge_report_memory(memory_keys=None) -> dict:
    """Megatron-Bridge 0.3.1's report_memory, as written (import math hoisted)."""
    import math

    memory_stats = torch.cuda.memory_stats()
    memory_keys = memory_keys if memory_keys else BRIDGE_MEMORY_KEYS
    memory_report = {}
    for torch_name, name in memory_keys.items():
        if torch_name in memory_stats:
            if "bytes" in torch_name:
                gigabytes = memory_stats[torch_name] / 1.0e9
                if gigabytes != 0:
                    order_of_magnitude = int(math.floor(math.log10(abs(gigabytes))))
                    gigabytes = round(gigabytes, -order_of_magnitude + 4)
                memory_report[name.replace("bytes", "gigabytes")] = gigabytes
            else:
                memory_report[name] = memory_stats[torch_name]
    return memory_report


def bridge_reduce_max(memory_report: dict, pp_group, device: str = "cpu") -> dict:
    """Megatron-Bridge PR 3645's reduce_max_memory_across_pp_group (device="cpu" for gloo)."""
    if not memory_report:
        return memory_report
    if not dist.is_available() or not dist.is_initialized():
        return memory_report
    pp_size_attr = getattr(pp_group, "size", None)
    if not callable(pp_size_attr) or pp_size_attr() <= 1:
        return memory_report
    return bridge_all_reduce_max(memory_report, pp_group, device)


def bridge_all_reduce_max(memory_report: dict, pp_group, device: str) -> dict:
    """The collective part of bridge_reduce_max (the GPU part runs it at world size 1 too)."""
    keys = list(memory_report.keys())
    values = torch.tensor([memory_report[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=pp_group)
    reduced = {}
    for key, max_val in zip(keys, values.tolist()):
        original = memory_report[key]
        if not isinstance(original, bool) and isinstance(original, int):
            reduced[key] = int(max_val)
        else:
            reduced[key] = max_val
    return reduced


def composer_reduce_value(value, group, reduce_op: str = "mean"):
    """Composer's MemoryMonitor reduce_value: a new tensor and one all_reduce per call."""
    tensor_value = torch.tensor(value, device="cpu")
    if reduce_op in ["mean", "avg", "sum"]:
        op = dist.ReduceOp.SUM
    elif reduce_op == "min":
        op = dist.ReduceOp.MIN
    elif reduce_op == "max":
        op = dist.ReduceOp.MAX
    else:
        raise ValueError(f"{reduce_op=} not supported.")
    dist.all_reduce(tensor_value, op=op, group=group)
    if reduce_op in ["mean", "avg"]:
        tensor_value = tensor_value / dist.get_world_size(group)
    return tensor_value.item()


def composer_reduce(memory_report: dict, group) -> dict:
    """Composer's dist_aggregate_batch_interval block: avg, min and max of every metric."""
    dist_memory_report = {}
    for mem_stat, val in memory_report.items():
        dist_memory_report[mem_stat + "_avg"] = composer_reduce_value(val, group, "avg")
        dist_memory_report[mem_stat + "_min"] = composer_reduce_value(val, group, "min")
        dist_memory_report[mem_stat + "_max"] = composer_reduce_value(val, group, "max")
    return dist_memory_report
