"""``nemo_memlog.bridge``, the documented name of ``nemo_memlog.integrations.bridge``: the same module
object (so its names and the module's attributes are one thing, whichever name imported it first).
A type checker reads the integration's names from here (the star import under TYPE_CHECKING)."""

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .integrations.bridge import *  # noqa: F403
else:
    from .integrations import bridge

    sys.modules[__name__] = bridge
