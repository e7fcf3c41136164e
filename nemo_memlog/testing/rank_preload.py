"""What every ``Cluster`` rank imports before its first line runs, imported once per test session in
multiprocessing's forkserver (``Cluster``'s start method) and inherited by every rank it forks: a rank
spawned afresh imported torch and megatron-core again, about 4 CPU-seconds each on two cores."""

import warnings

# megatron-core says at import that it falls back to torch's optimizers (no Transformer Engine, no Apex
# on CPU): said once per import, in the forkserver's stderr, it would land in whichever test runs then.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex")

import torch  # noqa: E402, F401
import torch.distributed  # noqa: E402, F401
from megatron.core import parallel_state  # noqa: E402, F401
