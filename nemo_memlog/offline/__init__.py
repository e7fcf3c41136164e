"""The offline commands: ``nemo-memlog report`` and ``nemo-memlog postmortem``.

They read what a run left on disk (TensorBoard events, flight records) and need no torch,
no process group and no training code. ``cli`` is the command line; ``report`` and
``postmortem`` analyse, their ``*_render`` and ``*_plot`` modules print and draw.
"""
