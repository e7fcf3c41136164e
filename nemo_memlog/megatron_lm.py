"""``nemo_memlog.megatron_lm``, the documented name of ``nemo_memlog.integrations.megatron_lm``: the same
module object (so ``from nemo_memlog.megatron_lm import install`` and the module's attributes are one
thing, whichever name imported it first)."""

import sys

from .integrations import megatron_lm

sys.modules[__name__] = megatron_lm
