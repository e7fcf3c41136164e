"""``nemo_memlog.bridge``, the documented name of ``nemo_memlog.integrations.bridge``: the same module
object (so ``from nemo_memlog.bridge import MemoryLogCallback`` and the module's attributes are one
thing, whichever name imported it first)."""

import sys

from .integrations import bridge

sys.modules[__name__] = bridge
