"""The switches every process reads from its environment, read one way on the package's side.

- ``NEMO_MEMLOG_DISABLED``: true turns every way in off (``nemo-memlog run``'s bootstrap installs
  nothing; ``megatron_lm.install()`` rebinds nothing; the callbacks do nothing; ``training_log``
  returns None): the job runs as without us. Every rank reads the same environment, so every rank
  agrees, and no collective is entered.
- ``NEMO_MEMLOG_DISABLED_INTEGRATIONS``: the ways in ``nemo-memlog run``'s bootstrap leaves out.
- ``NEMO_MEMLOG_CPU_STAND_INS``: the bootstrap's CPU stand-ins (``run --cpu``).
- ``NEMO_MEMLOG_<FIELD>`` (``env_name``): a LoggerConfig field's setting, which ``nemo-memlog run``
  checks at launch and its bootstrap reads in each process (integrations/instrument.py).

Spellings: ``TRUE_WORDS`` and ``FALSE_WORDS`` (case and surrounding blanks ignored). A value that is
neither reads as true for ``NEMO_MEMLOG_DISABLED`` (off is the safe reading of a switch someone
set), and ``nemo-memlog run`` refuses it at launch. The bootstrap (integrations/autorun/
sitecustomize.py) keeps its own copy of these names and words, since it imports nothing of
nemo_memlog at start-up; tests/test_run.py holds the two alike.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

DISABLED_ENV = "NEMO_MEMLOG_DISABLED"
DISABLED_WAYS_ENV = "NEMO_MEMLOG_DISABLED_INTEGRATIONS"
CPU_STAND_INS_ENV = "NEMO_MEMLOG_CPU_STAND_INS"
#: Settings from the environment: NEMO_MEMLOG_<FIELD in upper case>=value.
ENV_PREFIX = "NEMO_MEMLOG_"
TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off", "")


def env_name(field: str) -> str:
    """The environment variable of a LoggerConfig field: ``NEMO_MEMLOG_<FIELD>``."""
    return ENV_PREFIX + field.upper()


def switch_word(environ: Mapping[str, str], name: str) -> str:
    """Switch ``name``'s value in ``environ`` as it is compared: lower case, blanks stripped ("" unset)."""
    return environ.get(name, "").strip().lower()


def switched_off(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``NEMO_MEMLOG_DISABLED`` turns nemo_memlog off (default: this process's environment):
    any value but one of ``FALSE_WORDS``. A dictionary look-up; no collective, never raises."""
    return switch_word(os.environ if environ is None else environ, DISABLED_ENV) not in FALSE_WORDS
