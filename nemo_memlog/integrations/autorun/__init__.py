"""The folder ``nemo-memlog run`` puts first on ``PYTHONPATH``: its ``sitecustomize`` is the bootstrap
every Python process of the command runs at start (integrations/instrument.py)."""
