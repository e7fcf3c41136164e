"""The commands that start the user's job: ``nemo-memlog run`` and ``nemo-memlog fit``.

No torch, no process group: they start COMMAND (torchrun, srun, a script) and watch it from outside.

    run       ``nemo-memlog run -- COMMAND``: COMMAND with every Python process it starts instrumented
    fit/      ``nemo-memlog fit -- COMMAND``: the largest micro-batch size that fits, probed and confirmed
              (__init__: the search; probe: one launch watched to its steady peak; words, render: what it says)
    guard     the process between fit and a probe that ends everything the probe started, however fit ends
"""
