"""``nemo_memlog.lightning``, the documented name of ``nemo_memlog.integrations.lightning``: the same module
object (so ``from nemo_memlog.lightning import MemoryLogCallback`` and the module's attributes are one
thing, whichever name imported it first)."""

import sys

from .integrations import lightning

sys.modules[__name__] = lightning
