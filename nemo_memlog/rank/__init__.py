"""What one rank reads of itself, with no collective: its memory, its cgroup's limit, its place in the job.

memory       one rank's numbers: the allocator's statistics, host RSS, the device's use (report_memory)
host_limit   the memory cgroup's limit and use for this process (v1 and v2), or none
megatron     the job's shape from megatron-core's parallel_state, read without importing it where
             nothing did, and what a launch without a process group means
"""
