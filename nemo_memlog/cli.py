"""The ``nemo-memlog`` command. ``nemo-memlog report RUN_DIR`` prints the per-stage memory
table of a finished (or running) run and writes a PNG of one metric per stage.

Needs only tensorboard and matplotlib (``pip install nemo_memlog[report]``): no torch
import of its own, no training code, no process group.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PNG_NAME = "memory_report.png"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nemo-memlog", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser("report", help="per-stage memory table and PNG from a run's TensorBoard events")
    report.add_argument("run_dir", metavar="RUN_DIR", type=Path,
                        help="run directory (or its tensorboard dir; event files are found recursively), "
                             "or one event file; several runs in it: the newest is reported, the others listed")
    report.add_argument("--png", type=Path, default=None, help=f"where to write the plot (default: RUN_DIR/{PNG_NAME}, beside an event file)")
    report.add_argument("--metric", default=None,
                        help="per-stage metric to plot (default: peak_reserved_gb if logged, else peak_host_rss_gb)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Exit code: 0 on success, 2 on a usage error or a run directory that cannot be read."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_:  # argparse has printed the usage message
        return int(exit_.code or 0)
    from .report import ReportError

    try:
        return _report(args)
    except ReportError as error:
        print(f"nemo-memlog: error: {error}", file=sys.stderr)
        return 2


def _report(args) -> int:
    from .plot import write_png
    from .report import choose_metric, format_report, load_run

    run = load_run(args.run_dir)
    print(format_report(run))
    metric = choose_metric(run, args.metric)
    folder = args.run_dir.parent if args.run_dir.is_file() else args.run_dir
    png = write_png(run, metric, args.png or folder / PNG_NAME)
    print(f"\nplot of {metric} per stage: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
