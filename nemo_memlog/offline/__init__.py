"""The offline commands: ``nemo-memlog report``, ``postmortem`` and ``advise``.

They read what a run left on disk (TensorBoard events, flight records, per-layer records) and
need no torch, no process group and no training code. The command line is nemo_memlog/cli.py;
the commands that launch a job (run, fit) are in nemo_memlog/launch/. In the data's order:

    events          TensorBoard event files -> MemoryRun (the memory/ series of one run)
    rank_files      flight-record ring files -> RankFile (one per rank; format: failure.records)
    node_charge     per-layer records -> the nodes whose ranks share a memory cgroup (advise, fit, report)
    report/         MemoryRun -> the per-stage table (__init__); plot: its PNG; composition: the parts' PNG
    postmortem/     RankFiles -> Postmortem (__init__: status per rank, the first failure); state: the data;
                    sentence, render: the words; as_json: the JSON for a failure hook; plot: its PNG
    advise/         per-layer records -> each stage's parts today and under a change (__init__); plot: its PNG
    tables          what the renderers share: table layout, number and time formats
    plotting        what the PNGs share: the figure and its save
"""
