"""The offline commands: ``nemo-memlog report`` and ``nemo-memlog postmortem``.

They read what a run left on disk (TensorBoard events, flight records) and need no torch,
no process group and no training code. One line per module, in the data's order:

    cli                 the command line: parses, prints, writes the PNGs, sets the exit status
    events              TensorBoard event files -> MemoryRun (the memory/ series of one run)
    report              MemoryRun -> the per-stage table            report_plot      -> its PNG
    rank_files          flight-record ring files -> RankFile (one per rank; format: failure.records)
    postmortem          RankFiles -> Postmortem (status per rank, the first failure)
    postmortem_render   Postmortem -> the text                      postmortem_plot  -> its PNG
    postmortem_json     Postmortem -> the JSON for a failure hook
    node_charge         per-layer records -> the nodes whose ranks share a memory cgroup (advise, fit, report)
    tables, plotting    what the renderers share: table layout, number and time formats; figure and save
"""
