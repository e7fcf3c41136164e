"""``nemo-memlog run``'s bootstrap, run by Python's ``site`` at the start of every process of the
command (this folder is first on ``PYTHONPATH``): the user's own ``sitecustomize`` first (the next one
on the path), then the import hook of integrations/instrument.py. A Python that cannot import
nemo_memlog (another interpreter started by the command) runs as it would without."""

import importlib.machinery
import importlib.util
import os
import sys


def _chain() -> None:
    """Run the ``sitecustomize`` this one shadows, if any, as Python would have."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def _activate() -> None:
    try:
        from nemo_memlog.integrations import instrument
    except ImportError:  # another interpreter, without nemo_memlog
        return
    instrument.activate()


_chain()
_activate()
