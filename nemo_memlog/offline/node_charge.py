"""The ranks of a node under one memory cgroup, judged as the kernel charges them. No torch.

Each rank's RSS counts the pages its node's ranks share (the libraries' text, the page cache they
map) once per rank, while the kernel charges a shared page to the cgroup once: adding up per-rank
peak RSS, or splitting the limit evenly between ranks of unequal stages, says a size does not fit
where it runs. So where the ranks of a node share one memory cgroup (their per-layer records name
the same ``host_cgroup``: measure/layer_record.py), ``advise``, ``fit`` and ``report`` judge the
node: its peak charge now, and under a change that charge plus each of its ranks' predicted change
(``advice.Node``), against the limit. Without a shared cgroup (no limit, or one rank per cgroup)
nothing changes: each stage's peak against the limit shared by the node's ranks.

The node's peak charge is the smaller of two figures, each at or above the run's true peak:

- the cgroup's own peak (``host_limit_peak_gb``: v1 ``memory.max_usage_in_bytes``, v2
  ``memory.peak``): exact for a cgroup made for the run, but it keeps an earlier occupant's
  higher peak (fit's previous, larger probe in the same job's cgroup);
- the charge at the logging step plus each rank's rise from its RSS then to its peak RSS
  (``host_limit_used_gb`` + sum of ``peak_host_rss_gb - host_rss_gb``): this run's alone, taken
  only where every rank of the node has a record; an overestimate where the ranks' peaks do not
  coincide.
"""

from __future__ import annotations

from .. import advice
from ..keys import HOST_LIMIT, HOST_LIMIT_USED, HOST_RSS, PEAK_HOST_RSS


def _figure(record: dict, key: str) -> float | None:
    value = record.get("stage", {}).get(key)
    return float(value) if isinstance(value, (int, float)) and value == value and value > 0 else None


def nodes_of(records: list[dict]) -> tuple[advice.Node, ...]:
    """The nodes whose ranks share one memory cgroup, from every rank's per-layer record; () where
    any record names none (no limit, or records of an older nemo_memlog) or no cgroup holds two ranks."""
    groups: dict[str, list[dict]] = {}
    for record in records:
        name = record.get("host_cgroup")
        if not isinstance(name, str) or _figure(record, HOST_LIMIT.key) is None:
            return ()
        groups.setdefault(name, []).append(record)
    nodes = []
    for name, ranks in groups.items():
        charge = peak_charge(ranks)
        if len(ranks) < 2 or charge is None:
            return ()
        limit = min(_figure(record, HOST_LIMIT.key) or 0.0 for record in ranks)
        nodes.append(advice.Node(name, limit, charge, tuple(int(record["pp_rank"]) for record in ranks)))
    return tuple(nodes)


def peak_charge(ranks: list[dict]) -> float | None:
    """The node's peak charge in GB (module docstring): the smaller of its cgroup's own peak and its
    charge at the step plus its ranks' rises; None where neither is known."""
    candidates = [peak for peak in (_figure(record, "host_limit_peak_gb") for record in ranks) if peak]
    local = max(int(record.get("local_world_size") or 1) for record in ranks)
    used = [_figure(record, HOST_LIMIT_USED.key) for record in ranks]
    rises = [(_figure(r, PEAK_HOST_RSS.key), _figure(r, HOST_RSS.key)) for r in ranks]
    if len(ranks) >= local and None not in used and all(None not in pair for pair in rises):
        candidates.append(max(used) + sum(max(peak - now, 0.0) for peak, now in rises))  # type: ignore[operator]
    return min(candidates) if candidates else None


def capacity_text(nodes: tuple[advice.Node, ...]) -> str:
    """How the capacity is judged under a shared cgroup, in words, for the capacity line."""
    node = max(nodes, key=lambda node: node.charge_gb / node.limit_gb)
    ranks = len(node.stages)
    where = f"the node's {ranks} ranks" + (f" (of {len(nodes)} nodes, the fullest)" if len(nodes) > 1 else "")
    return (
        f"judged per node: {where} share the memory cgroup's limit {advice.fmt(node.limit_gb)}; its peak charge "
        f"{advice.fmt(node.charge_gb)} counts shared pages once, and a change adds each rank's predicted change"
    )
