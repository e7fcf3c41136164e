"""How long a new MLflow SQLite store takes to make: MLflow's own (its tables and schema migrations)
against ours, a copy of the empty store cached for this MLflow version (``writers/mlflow.py``'s
``create_sqlite_store``). One process; the cache is made first; then each repetition makes one store
each way, interleaved, in fresh files of a temporary folder. Median CPU and wall seconds per store.

    python scripts/bench_mlflow_open.py            # 6 repetitions
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=6)
    reps = parser.parse_args().reps
    logging.getLogger("mlflow").setLevel(logging.WARNING)  # its INFO line per migration
    from mlflow.tracking import MlflowClient

    from nemo_memlog.writers import mlflow as mlflow_writer

    with tempfile.TemporaryDirectory() as folder:
        made = {"mlflow's own": [], "copy of the cached empty store": []}
        mlflow_writer.create_sqlite_store(f"sqlite:///{folder}/first.db", MlflowClient)  # the cache, if missing
        for rep in range(reps):
            for number, (way, times) in enumerate(made.items()):
                uri = f"sqlite:///{Path(folder) / f'{rep}-{number}.db'}"
                cpu, wall = time.process_time(), time.perf_counter()
                if way.startswith("copy"):
                    mlflow_writer.create_sqlite_store(uri, MlflowClient)
                else:
                    MlflowClient(uri).search_experiments()  # creates and migrates
                times.append((time.process_time() - cpu, time.perf_counter() - wall))
                print(f"  rep {rep + 1}/{reps}: {way}: {times[-1][1]:.3f} s", flush=True)
    print(f"a new SQLite store, median of {reps} (MLflow {__import__('mlflow').__version__}):")
    for way, times in made.items():
        cpu, wall = statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)
        print(f"  {way:32s} CPU {cpu:.3f} s, wall {wall:.3f} s")


if __name__ == "__main__":
    main()
