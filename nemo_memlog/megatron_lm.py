"""``nemo_memlog.megatron_lm``, the documented name of ``nemo_memlog.integrations.megatron_lm``: the same module
object (so its names and the module's attributes are one thing, whichever name imported it first).
A type checker reads the integration's names from here (the star import under TYPE_CHECKING)."""

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .integrations.megatron_lm import *  # noqa: F403
else:
    from .integrations import megatron_lm

    sys.modules[__name__] = megatron_lm
