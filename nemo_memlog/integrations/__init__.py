"""The integrations: one thin module per framework, translating its events, steps, groups and
open loggers into the core's terms (a MemoryMonitor). Nothing in the core imports them.

- ``door``: ``Adapter``, what every integration shares: the run it holds and its ``@guarded`` events;
- ``megatron_lm``: Megatron-LM's own loop, ``install()`` around one ``LoopMemoryLog``
  (documented as ``nemo_memlog.megatron_lm``);
- ``bridge``: Megatron-Bridge's ``pretrain()`` callbacks (documented as ``nemo_memlog.bridge``);
- ``lightning``: a Lightning callback for NeMo 2 and Lightning (``nemo_memlog.lightning``);
- ``instrument``: ``nemo-memlog run``'s side in each Python process: a framework's way in, added once
  the framework is imported;
- ``autorun/``: the folder ``nemo-memlog run`` puts first on ``PYTHONPATH`` (its ``sitecustomize``,
  the bootstrap).
"""
