"""The integrations: one thin module per framework, translating its events, steps, groups and
open loggers into the core's terms (a MemoryMonitor). Nothing in the core imports them.

- ``bridge``: Megatron-Bridge's ``pretrain()`` callbacks (documented as ``nemo_memlog.bridge``);
- ``lightning``: a Lightning callback for NeMo 2 and Lightning (``nemo_memlog.lightning``).
"""
