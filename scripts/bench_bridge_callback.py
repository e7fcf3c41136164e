"""What MemoryLogCallback costs on an iteration it does not log, next to training_log's cost.

    python scripts/bench_bridge_callback.py                 # PP 2 x DP 2 (world 4), 20000 calls each
    python scripts/bench_bridge_callback.py --world 2 --pp 2 --calls 5000

Every rank (gloo, megatron-core's parallel_state) builds a real Megatron-Bridge GlobalState
and ConfigContainer (nemo_memlog/testing/bridge_harness.py), fires on_train_start through Bridge's
CallbackManager, then times, interleaved and alternating which goes first:
``on_train_step_end`` off-interval (the method Bridge's manager calls) and
``nemo_memlog.training_log`` off-interval, and counts the collectives both issued.
Medians in microseconds; the timer's own cost ("empty") is shown, not subtracted. Nothing
asserts a time: on a shared machine only numbers from one interleaved run compare.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nemo_memlog.testing.bridge_probes import bench_off_interval  # noqa: E402
from nemo_memlog.testing.cluster import Cluster  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    with Cluster(world=args.world, pp=args.pp) as cluster:
        results = cluster.run_ok(bench_off_interval, args.calls, timeout=600)
    print(f"off-interval cost, world {args.world}, PP {args.pp}, {args.calls} interleaved calls each, median us")
    print(f"{'rank':>4} {'on_train_step_end':>18} {'training_log':>13} {'empty timer':>12} {'collectives':>12}")
    for rank, result in enumerate(results):
        print(
            f"{rank:>4} {result['callback_us']:>18.3f} {result['training_log_us']:>13.3f} "
            f"{result['empty_us']:>12.3f} {len(result['collectives']):>12}"
        )


if __name__ == "__main__":
    main()
