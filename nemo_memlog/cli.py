"""The ``nemo-memlog`` command: ``report RUN_DIR`` prints the per-stage memory table of a run and writes
a PNG; ``postmortem RUN_DIR`` says which rank of a job that died failed first, and what every rank held;
``advise RUN_DIR --what-if NAME=VALUE`` predicts each stage's memory under a change; ``fit -- COMMAND``
finds the largest micro-batch size that fits every stage; ``run -- COMMAND`` adds memory logging to
every Python process of COMMAND, with no code change. ``nemo-memlog COMMAND --help`` for each.

Reads the command line; prints what report.py and postmortem/render.py (or postmortem/as_json.py)
return, and writes the PNG of report/plot.py or postmortem/plot.py. Needs only tensorboard and
matplotlib (``pip install nemo_memlog[report]``; the post-mortem needs matplotlib only for its PNG):
no torch import of its own, no training code, no process group.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from .commands import CANNOT_TELL, CLOSED_PIPE, DONE, FOUND_FAILURE, INTERRUPTED, NOTHING_FITS, USAGE_ERROR
from .launch import run

RUN_HELP = "COMMAND with memory logging in every Python process it starts, no code change (docs/megatron_lm.md)"
PNG_NAME = "memory_report.png"
POSTMORTEM_PNG_NAME = "memory_postmortem.png"
ADVISE_PNG_NAME = "memory_advise.png"


# The command line's argument types: each a checked number, or argparse's error saying what to write.


def fraction(text: str) -> float:
    """An argparse type: a number from 0 up to (not including) 1."""
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a share from 0 up to 1 (0.1 is 10%) is expected")
    return value


def whole(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number >= 1 is expected")
    return value


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: a number of seconds >= 0 is expected")
    return value


def gigabytes(text: str) -> float:
    """An argparse type: a finite number of GB above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: a number of GB above 0 is expected")
    return value


def _parser() -> argparse.ArgumentParser:
    """The commands and their options."""
    parser = argparse.ArgumentParser(prog="nemo-memlog", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser("report", help="per-stage memory table and PNG from a run's TensorBoard events")
    report.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        type=Path,
        help="run directory (or its tensorboard dir; event files are found recursively), "
        "or one event file; several runs in it: the newest is reported, the others listed",
    )
    report.add_argument(
        "--png",
        type=Path,
        default=None,
        help=f"where to write the plot (default: RUN_DIR/{PNG_NAME}, beside an event file)",
    )
    report.add_argument(
        "--metric",
        default=None,
        help="per-stage metric to plot (default: peak_reserved_gb if logged, else peak_host_rss_gb)",
    )
    report.add_argument(
        "--records",
        type=Path,
        default=None,
        metavar="DIR",
        help="the per-layer records' folder where it is not RUN_DIR's memory_records (memory_record_dir set "
        "elsewhere, a fit probe's folder): the capacity, layout and headroom lines come from it",
    )
    _postmortem_parser(commands)
    _advise_parser(commands)
    _fit_parser(commands)
    commands.add_parser("run", help=RUN_HELP)  # listed; main() hands run.main its arguments unparsed
    return parser


def _fit_parser(commands) -> None:
    """``fit`` and its options, added to ``commands``."""
    fit = commands.add_parser(
        "fit",
        help="the largest micro-batch size that fits every stage, from probes of your own launch",
        description="Launch COMMAND (with {micro_batch_size} where the size goes) at one size, end it once every "
        "rank's peak has stopped rising (at most 8 measured logging steps), predict the largest size that fits "
        "every pipeline stage, and confirm it with another launch (docs/fit.md). Exit status: 0 with an answer, "
        "2 when even the smallest size does not fit (or a usage error), 1 when fit cannot tell (a probe could not "
        "measure: timed out, ended early, died but not of memory, a bad record; the command keeps its "
        "microbatches, not its global batch), 130/143 interrupted.",
    )
    fit.add_argument("job", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="your launch, after --")
    fit.add_argument("--capacity-gb", type=gigabytes, default=None, help="memory per rank (default: as advise)")
    fit.add_argument("--margin", type=fraction, default=0.1, help="share of the capacity left free (default 0.1)")
    fit.add_argument(
        "--start",
        type=whole,
        default=None,
        help="the first probe's size (default: {micro_batch_size:N}'s N, else 1)",
    )
    fit.add_argument("--max-launches", type=whole, default=3, help="probes at most (default 3)")
    fit.add_argument(
        "--probe-timeout-s",
        type=seconds,
        default=1800.0,
        help="longest wait for a probe's records (default 1800)",
    )
    fit.add_argument("--grace-s", type=seconds, default=30.0, help="SIGTERM to SIGKILL for a probe (default 30)")
    fit.add_argument("--work-dir", type=Path, default=None, help="keep the probes' records and output here")
    fit.add_argument(
        "--from-records",
        type=Path,
        default=None,
        metavar="DIR",
        help="a run of this same COMMAND you already have (its memory_records folder, at any size): its measurement "
        "replaces the first probe, one launch fewer",
    )
    fit.add_argument("--json", action="store_true", help="print one JSON object")


def _advise_parser(commands) -> None:
    """``advise`` and its options, added to ``commands``."""
    from .advice import CHANGES

    forms = "; ".join(f"{name}={form}" for name, form in CHANGES.items())
    advise = commands.add_parser(
        "advise",
        help="what a micro-batch, layout, optimizer-sharding or recompute change does to each stage's peak",
        description="Predict each stage's memory under a change, from the run's own measurement (its per-layer "
        "records). Exit status: 0 printed (fits or not), 2 usage error, no records, or a change the records "
        "cannot support (the message says what is missing).",
    )
    advise.add_argument(
        "run_dir", metavar="RUN_DIR", type=Path, help="run directory, its tensorboard dir, or its memory_records"
    )
    advise.add_argument(
        "--what-if",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=f"a change; several together describe one combined change. {forms}",
    )
    advise.add_argument(
        "--capacity-gb",
        type=gigabytes,
        default=None,
        help="memory per rank to fit in (default: the device's total; on CPU the job's memory cgroup limit, "
        "else the node's RAM divided by the ranks on it)",
    )
    advise.add_argument(
        "--fit",
        action="store_true",
        help="also list the changes that fit (--margin of the capacity free), cheapest first: the micro-batch "
        "size, the distributed optimizer, recompute, a layer split",
    )
    advise.add_argument("--margin", type=fraction, default=0.1, help="with --fit: share left free (default 0.1)")
    advise.add_argument(
        "--calibrate-with",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="a second run of the same job at another micro-batch size: the temporaries then grow as the two "
        "show (default: in proportion to the micro-batch)",
    )
    advise.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    advise.add_argument(
        "--png", type=Path, default=None, help="where to write the picture (default: RUN_DIR/memory_advise.png)"
    )
    advise.add_argument("--no-png", action="store_true", help="write no picture")


def _postmortem_parser(commands) -> None:
    """``postmortem`` and its options, added to ``commands``."""
    from .offline.postmortem.state import DEFAULT_CLOCK_SKEW_S

    postmortem = commands.add_parser(
        "postmortem",
        help="which rank failed first, and every rank's memory, from the flight records",
        description="Read the per-rank flight records below RUN_DIR and lead with the first failure. "
        "Exit status: 0 no failure, 1 a failure found, 2 usage error or nothing readable.",
    )
    postmortem.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        type=Path,
        help="the run's memory_record_dir or any folder above it (searched recursively)",
    )
    postmortem.add_argument(
        "--json", action="store_true", help="print the machine-readable form (for a failure hook); no PNG unless --png"
    )
    postmortem.add_argument(
        "--png",
        type=Path,
        default=None,
        help=f"where to write the plot (default without --json: RUN_DIR/{POSTMORTEM_PNG_NAME})",
    )
    postmortem.add_argument("--no-png", action="store_true", help="write no plot")
    postmortem.add_argument(
        "--all",
        action="store_true",
        help="a table row for every rank (default: every rank up to 64, else a selection "
        "and a summary per pipeline stage)",
    )
    postmortem.add_argument(
        "--run-id",
        default=None,
        help="the run to report when the folder holds records of several (default: the newest)",
    )
    postmortem.add_argument(
        "--clock-skew-s",
        type=seconds,
        default=DEFAULT_CLOCK_SKEW_S,
        help="how far apart two hosts' clocks may be, in seconds (default: %(default)s)",
    )


def main(argv: list[str] | None = None) -> int:
    """Exit code: 0 on success, 2 on a usage error or a run directory that cannot be read; 141 when
    the output's reader closed the pipe (quietly: the rest of the output goes nowhere)."""
    as_command = argv is None  # the process is this command: run passes on the environment it was given
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:  # COMMAND's own options must reach it untouched
        return run.main(argv[1:], as_command=as_command)
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_:  # argparse has printed the usage message
        return int(exit_.code or 0)
    try:
        code = _command(args)
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_stdout()
        return CLOSED_PIPE
    return code


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's own flush at exit finds no closed pipe
    (Python's documented way: https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is no file (a test's StringIO)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process


def _command(args) -> int:
    if args.command == "postmortem":
        return _postmortem(args)
    if args.command == "advise":
        return _advise(args)
    if args.command == "fit":
        return _fit(args)
    from .offline.report import ReportError

    try:
        return _report(args)
    except ReportError as error:
        hint = _record_hint(args.run_dir)
        print(f"nemo-memlog: error: {error}" + (f"\n{hint}" if hint else ""), file=sys.stderr)
        return USAGE_ERROR


def _advise(args) -> int:
    """Exit code 0 with the prediction printed; 2 for bad input, no records or a refused change."""
    import dataclasses

    from . import advice
    from .offline.advise import Advice, AdviseError, as_json, as_text, load

    try:
        changes = advice.parse(args.what_if)
        profile = load(args.run_dir, args.capacity_gb, _read_budget())
        if args.calibrate_with is not None:
            other = load(args.calibrate_with, args.capacity_gb, _read_budget())
            difference = advice.job_difference(profile, other)
            if difference is not None:
                raise AdviseError(
                    f"--calibrate-with {args.calibrate_with} is not this job at another micro-batch size: {difference}"
                )
            profile = dataclasses.replace(profile, temporaries_growth=advice.growth_between(profile, other))
        outcomes = advice.predict(profile, changes)
    except (AdviseError, ValueError) as error:  # advice.Refused is a ValueError
        print(f"nemo-memlog advise: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    best = advice.max_micro_batch_size(profile, changes)
    fixes = advice.changes_that_fit(profile, args.margin) if args.fit else None
    png = None
    if not args.no_png:
        folder = args.run_dir if args.run_dir.is_dir() else args.run_dir.parent
        png = _advise_png(profile, changes, outcomes, args.png or folder / ADVISE_PNG_NAME)
    if args.json:
        print(as_json(Advice(profile, changes, outcomes, best, fixes, args.margin)))
    else:
        print(as_text(Advice(profile, changes, outcomes, best, fixes, args.margin)))
        if png:
            print(f"\nplot of each stage today and predicted: {png}")
    return 0


def _fit(args) -> int:
    """Exit code 0 with an answer, 2 when nothing fits or for a usage error, 1 when fit cannot tell: from
    what happened, never from a message's words. --json: one object whatever happens (with ``error``)."""
    import signal

    from .launch.fit import FitError, Options, search
    from .launch.fit.render import as_json, as_text, error_json
    from .redaction import launch_secrets, scrubbed_text

    command = args.job[1:] if args.job[:1] == ["--"] else args.job
    options = Options(
        command,
        capacity_gb=args.capacity_gb,
        margin=args.margin,
        start=args.start,
        max_launches=args.max_launches,
        probe_timeout_s=args.probe_timeout_s,
        grace_s=args.grace_s,
        work_dir=args.work_dir,
        from_records=args.from_records,
        say=lambda line: print(f"nemo-memlog fit: {line}", file=sys.stderr, flush=True),  # stdout: the answer
    )
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        result = search(options)
    except FitError as error:
        # A usage error may quote the command.
        message = scrubbed_text(str(error), launch_secrets(command, dict(os.environ)))
        if args.json:
            print(error_json(message))
        print(f"nemo-memlog fit: error: {message}", file=sys.stderr)
        return error.code
    except KeyboardInterrupt as interrupt:
        print("nemo-memlog fit: interrupted; every probe's processes ended", file=sys.stderr)
        return INTERRUPTED["SIGTERM" if interrupt.args == ("SIGTERM",) else "SIGINT"]
    if args.json:
        print(as_json(result, options))
    elif result.error is None:
        print(as_text(result, options))
    if result.error is not None:
        print(f"nemo-memlog fit: {'' if result.interrupted else 'error: '}{result.error}", file=sys.stderr)
        return INTERRUPTED.get(result.interrupted or "", CANNOT_TELL)
    return DONE if result.micro_batch_size is not None else NOTHING_FITS


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt("SIGTERM")


def _advise_png(profile, changes, outcomes, path) -> Path | None:
    try:
        from .offline.advise.plot import write_png

        return write_png(profile, changes, outcomes, path)
    except Exception as error:  # a read-only folder, no matplotlib, figures it cannot draw: never the advice
        print(
            f"nemo-memlog: warning: no plot written ({type(error).__name__}: {error}); --png PATH to write it "
            "elsewhere, --no-png for none",
            file=sys.stderr,
        )
        return None


def _postmortem(args) -> int:
    """Exit code 1 when a failure was found, 0 when every rank closed, 2 when nothing could be read."""
    from .offline.postmortem import PostmortemError, analyse
    from .offline.postmortem import plot as postmortem_plot
    from .offline.postmortem.as_json import json_text
    from .offline.postmortem.render import format_text

    try:
        postmortem = analyse(args.run_dir, run_id=args.run_id, clock_skew_s=args.clock_skew_s, budget=_read_budget())
    except PostmortemError as error:
        print(f"nemo-memlog: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    png = None
    if not args.no_png and (args.png or not args.json):
        png = _png(postmortem_plot.write_png, (postmortem, args.png or args.run_dir / POSTMORTEM_PNG_NAME))
    if args.json:
        print(json_text(postmortem, str(png) if png else None))
    else:
        print(format_text(postmortem, all_rows=args.all))
        if png:
            print(f"\nplot of the last records per stage and when each rank stopped: {png}")
    return FOUND_FAILURE if postmortem.first_failure is not None else DONE


def _read_budget():
    """One run's read budget (bounded.ReadBudget), its progress on stderr: stdout is the answer."""
    from .bounded import ReadBudget

    return ReadBudget(say=lambda line: print(f"nemo-memlog: {line}", file=sys.stderr, flush=True))


def _report(args) -> int:
    """Exit code 0; raises ReportError when the run cannot be reported on."""
    from .offline.report import choose_metric, format_report, load_run, records_run
    from .offline.report import composition as composition_plot
    from .offline.report.plot import write_png

    memory_run = load_run(args.run_dir)
    records = records_run(memory_run, args.records, _read_budget())
    print(format_report(memory_run, records))
    hint = _record_hint(args.run_dir)
    if hint:
        print(hint)
    metric = choose_metric(memory_run, args.metric)
    folder = args.run_dir.parent if args.run_dir.is_file() else args.run_dir
    png = _png(write_png, (memory_run, metric, args.png or folder / PNG_NAME, records))
    if png is not None:
        print(f"\nplot of {metric} per stage: {png}")
        if composition_plot.has_composition(memory_run):
            composition = png.with_name(png.stem + "_composition.png")
            parts = _png(composition_plot.write_png, (memory_run, composition, records))
            if parts is not None:
                print(f"what each stage's memory is made of: {parts}")
    return 0


def _png(write, arguments: tuple) -> Path | None:
    """``write(*arguments)``, or None with a warning: a read-only copy of the run, or no matplotlib,
    must not hide the table or the post-mortem."""
    try:
        return write(*arguments)
    except Exception as error:  # a read-only folder, no matplotlib, figures it cannot draw
        print(
            f"nemo-memlog: warning: no plot written ({type(error).__name__}: {error}); "
            "--png PATH to write it elsewhere",
            file=sys.stderr,
        )
        return None


def _record_hint(run_dir) -> str | None:
    """One line for ``report``: where flight records are, if any are below ``run_dir``."""
    from .commands import postmortem_command
    from .offline.rank_files import find_record_files

    try:
        found = next(iter(find_record_files(run_dir)), None)
    except OSError:
        return None
    if found is None:
        return None
    return (
        f"flight records found under {found.parent}: `{postmortem_command(run_dir)}` says which rank "
        "failed first and what every rank held"
    )


if __name__ == "__main__":
    sys.exit(main())
