"""``nemo-memlog fit -- COMMAND``: the largest micro-batch size whose measured peak leaves ``margin`` of
the capacity free on every pipeline stage, found from the job itself and confirmed before it is
handed back. No torch: the probes are the user's own launches (launch/fit/probe.py), the predictions
``advice``'s arithmetic over what they recorded.

The search: the first probe (``start``) measures every stage (or a run the user already has, given by
its records: ``from_records``, a measurement that costs no launch); ``advice`` predicts the largest
candidate size that fits (the sizes that keep the global batch whole, from the probe's facts); the
next probe runs it. From two measured sizes the temporaries (the working set of the microbatch
being computed) grow as the two show (``advice.growth_between``: x F**p, p per stage), and each
prediction is made from the measured run nearest in size. A probe that fits raises the floor, one that does not (over
the limit, or killed: an OOM) lowers the ceiling; the next size is the largest predicted to fit
between them, until none is left or ``max_launches`` is spent. The answer is always a size a probe
of this fit measured to fit: each probe starts from an empty folder, and one that could not measure
(it timed out, ended early, died of something other than memory, or wrote a record advise refuses)
ends the search with an error naming it, never "over the limit". (With ``from_records``, that run's
own measurement counts as one: it may be the answer.) Everything fit prints or writes has
the command's secrets scrubbed (redaction.py). docs/fit.md says what a probe costs and how accurate
the predictions were.

This module holds the search; beside it:

- ``probe``: one launch of the user's command at one size, watched until every rank's peak is steady;
- ``words``: what fit says as it goes and where it stops (secrets scrubbed);
- ``render``: what fit prints, as text or as one JSON object.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ... import advice
from ...commands import CANNOT_TELL, USAGE_ERROR
from ...measure import layer_record
from ...offline.advise import AdviseError, load
from ...redaction import launch_secrets, scrubbed_text
from ..guard import Guarded
from . import words
from .probe import MAX_STEPS, PROBE_DIR_ENV, STEPS, Probe, recorded_steps, run_probe
from .words import PLACEHOLDER, SLOT

#: Candidate sizes predicted one by one up to this many; above it, bisected (as advise's search).
PREDICT_EACH = 64
#: Candidates listed in the JSON at most (their count is given whole).
CANDIDATES_SHOWN = 128
#: The error the advice's peak prediction was held to against reruns (docs/fit.md): a size above the
#: largest predicted to fit, but predicted to miss the limit by less than this, is probed too.
PREDICTION_ERROR = 0.10


class FitError(Exception):
    """fit cannot go on; the message says why and what to change; ``code`` the exit status."""

    def __init__(self, message: str, code: int = CANNOT_TELL):
        super().__init__(message)
        self.code = code


@dataclass
class Options:
    command: list[str]
    capacity_gb: float | None = None
    margin: float = 0.1
    start: int | None = None
    max_launches: int = 3
    probe_timeout_s: float = 1800.0
    grace_s: float = 30.0
    work_dir: Path | None = None
    #: A records folder of a run of this same COMMAND at some size (``nemo-memlog run``'s, or a fit probe's):
    #: the first measurement, read instead of launched. Checked before anything is launched.
    from_records: Path | None = None
    #: Where fit says what it is doing as it goes (a probe starts, how far it is, its verdict): one line
    #: at a time, secrets scrubbed; the command line gives stderr, so --json stays one object on stdout.
    say: Callable[[str], None] | None = None


@dataclass
class Launch:
    """One probe and what was made of it: its run (None: nothing usable recorded), the peaks
    predicted for its size before it ran, and whether every stage stayed within the limit."""

    probe: Probe
    run: advice.Profile | None
    predicted: list[float] | None
    fits: bool

    @property
    def outcome(self) -> str:
        """ "fits", "over the limit" (measured over, or died of memory) or "could not measure"."""
        if self.fits:
            return "fits"
        if (self.probe.measured and self.run is not None) or self.probe.out_of_memory:
            return "over the limit"
        return "could not measure"


@dataclass
class Result:
    micro_batch_size: int | None
    launches: list[Launch]
    limit_gb: float | None
    capacity_gb: float | None
    capacity_source: str
    seconds: float
    candidates: Sequence[int]
    alternatives: list[advice.Fix] = field(default_factory=list)
    answer: Launch | None = None
    error: str | None = None  # why fit cannot tell (exit CANNOT_TELL); then no answer
    interrupted: str | None = None  # "SIGINT" or "SIGTERM": the search stopped there (what was measured stays)
    secrets: list[str] = field(default_factory=list)  # scrubbed from anything shown
    notes: list[str] = field(default_factory=list)  # what the user may want to change in COMMAND (shared_tensorboard)


def command_for(command: list[str], size: int) -> list[str]:
    """``command`` with every PLACEHOLDER (``{micro_batch_size}`` or ``{micro_batch_size:N}``) replaced by ``size``."""
    return [SLOT.sub(str(size), part) for part in command]


def stated_size(command: list[str]) -> int | None:
    """The size the command would use, where a placeholder states it (``{micro_batch_size:8}``)."""
    sizes = {int(match.group(1)) for part in command for match in SLOT.finditer(part) if match.group(1)}
    if len(sizes) > 1:
        raise FitError(f"COMMAND states several sizes in its placeholders ({sorted(sizes)}): state one", USAGE_ERROR)
    return sizes.pop() if sizes and min(sizes) > 0 else None


def check_command(command: list[str]) -> None:
    if not command:
        raise FitError(f"no COMMAND: nemo-memlog fit [options] -- COMMAND ... {PLACEHOLDER} ...", USAGE_ERROR)
    if not any(SLOT.search(part) for part in command):
        raise FitError(f"COMMAND has no {PLACEHOLDER}: {words.placeholder_hint(command)}", USAGE_ERROR)


def check_work_dir(work_dir: Path) -> None:
    """FitError (USAGE_ERROR, one line) where ``work_dir`` cannot hold the probes' folders: a file, a folder
    that cannot be written, /proc. Made where missing; tried by making (and removing) a folder in it."""
    try:
        work_dir.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".nemo-memlog-fit-", dir=work_dir))
    except OSError as error:
        raise FitError(f"--work-dir {work_dir}: cannot be used ({error.strerror or error})", USAGE_ERROR) from None


def search(options: Options) -> Result:
    """Probe, predict, confirm (module docstring). Raises FitError (USAGE_ERROR) for a command or --work-dir
    that cannot be used; where fit cannot tell, the Result's ``error`` says why (the scratch folder
    of the probes is then kept, and named)."""
    check_command(options.command)
    stated_size(options.command)
    if options.work_dir is not None:
        check_work_dir(options.work_dir)
    if options.from_records is not None and options.start is not None:
        raise FitError("--start and --from-records: give one (fit starts from the records' size)", USAGE_ERROR)
    recorded = recorded_run(options.from_records) if options.from_records is not None else None
    began = time.monotonic()
    secrets = launch_secrets(options.command, dict(os.environ))
    scratch = None if options.work_dir else Path(tempfile.mkdtemp(prefix="nemo-memlog-fit-"))
    # Removes the scratch folder should fit be killed outright (between probes too): guard.py.
    keeper = Guarded([], dict(os.environ), 0.0, scratch, output=False) if scratch is not None else None
    work = options.work_dir or scratch
    assert work is not None  # one of the two is given
    state = _Search(options, work, secrets, scratch, recorded)
    notes = [note for note in [words.shared_tensorboard(options.command)] if note]
    for note in notes:
        state._say(f"note: {note}")
    error, late, interrupted = None, None, None
    try:
        state.run()
    except FitError as failed:
        error = str(failed) + (f"\nthe probes' records and output are kept in {scratch}" if scratch else "")
    except KeyboardInterrupt as interrupt:  # every probe's processes have ended (run_probe): say what was measured
        interrupted = "SIGTERM" if interrupt.args == ("SIGTERM",) else "SIGINT"
        error = words.interrupted(interrupted, state)
    finally:
        if scratch is not None and (error is None or interrupted):  # interrupted: the JSON holds what was measured
            shutil.rmtree(scratch, ignore_errors=True)
        late = keeper.end() if keeper is not None else None
    if late is not None:
        raise late
    return Result(
        micro_batch_size=state.best.probe.micro_batch_size if state.best and error is None else None,
        launches=state.launches,
        limit_gb=state.limit,
        capacity_gb=state.capacity,
        capacity_source=state.capacity_source,
        seconds=time.monotonic() - began,
        candidates=state.candidates,
        alternatives=state.alternatives,
        answer=state.best if error is None else None,
        error=scrubbed_text(error, secrets) if error else None,
        interrupted=interrupted,
        secrets=secrets,
        notes=[scrubbed_text(note, secrets) for note in notes],
    )


def recorded_run(folder: Path) -> Probe:
    """``folder`` (--from-records) as a measurement: a Probe of status "recorded" at the size its records
    state, every rank having recorded at least STEPS measured steps. FitError (USAGE_ERROR) naming what
    to change where the folder cannot serve; nothing is launched before this is known."""
    where = f"--from-records {folder}"
    if not folder.is_dir():
        raise FitError(f"{where}: not a folder (give a run's memory_records folder)", USAGE_ERROR)
    try:
        profile = load(folder)
    except AdviseError as error:
        raise FitError(f"{where}: {error}", USAGE_ERROR) from None
    if profile.micro_batch_size is None:
        raise FitError(
            f"{where}: its records do not state the run's micro-batch size (a run of Megatron's schedule "
            "under nemo-memlog records it): give fit a run that does, or let it probe (no --from-records)",
            USAGE_ERROR,
        )
    probe = Probe(profile.micro_batch_size, folder, status="recorded")
    if not recorded_steps(probe):
        least = min((max(seen, default=0) for seen in probe.peaks.values()), default=0)
        raise FitError(
            f"{where}: a rank recorded {least} measured logging steps, fewer than the {STEPS} a measurement "
            "needs (the first precedes the optimizer's state): give a run that logged more steps",
            USAGE_ERROR,
        )
    return probe


class _Search:
    def __init__(self, options: Options, work: Path, secrets: list[str], scratch: Path | None, recorded: Probe | None):
        self.options, self.work, self.secrets = options, work, secrets
        self.recorded = recorded  # the run of --from-records: the first measurement, not launched
        self.scratch = scratch  # the temporary folder, removed by the probes' guards should fit be killed
        self.launches: list[Launch] = []
        self.best: Launch | None = None  # the largest size measured to fit
        self.ceiling: int | None = None  # the smallest size measured not to fit
        self.limit: float | None = None
        self.capacity: float | None = None
        self.capacity_source = ""
        self.candidates: Sequence[int] = []
        self.alternatives: list[advice.Fix] = []

    @property
    def launched(self) -> int:
        """The probes launched so far (``launched``)."""
        return launched(self.launches)

    def run(self) -> None:
        if self.recorded is not None:
            first = self._judged(self.recorded, None, "records")
        else:
            first = self._launch(self.options.start or stated_size(self.options.command) or 1, None)
        if first.run is None:
            raise FitError(words.no_measurement(first.probe, self.options))
        if first.outcome == "could not measure":
            raise FitError(words.could_not_measure(1, first, self.best, self.options))
        self.candidates = _candidates(first.run)
        size = self._next()
        while size is not None and self.launched < self.options.max_launches:
            launch = self._launch(size, self._predicted(size))
            if launch.outcome == "could not measure":
                raise FitError(words.could_not_measure(self.launched, launch, self.best, self.options))
            size = self._next()
        if self.best is None:
            seen = [launch for launch in self.launches if launch.run]  # the smallest size, measured ones first
            nearest = min(seen, key=lambda launch: (not launch.probe.measured, launch.probe.micro_batch_size))
            assert nearest.run is not None
            self.alternatives = advice.changes_that_fit(nearest.run, self.options.margin)

    def _say(self, text: str) -> None:
        if self.options.say is not None:
            self.options.say(scrubbed_text(text, self.secrets))

    def _launch(self, size: int, predicted: list[float] | None) -> Launch:
        number = self.launched + 1
        folder = self.work / f"probe-{number}-mbs-{size}"
        command = command_for(self.options.command, size)
        expected = f" (predicted peaks per stage {words.sizes(predicted)})" if predicted else ""
        self._say(f"probe {number}: micro-batch size {size}{expected}: starting {words.shown(command)}")

        def progress(probe: Probe, seconds: float) -> None:
            ranks = f"{probe.ranks_recorded} of {probe.world_size}" if probe.world_size else "none yet"
            steps = f"measured steps {probe.steps} (at most {MAX_STEPS}); " if probe.steps else ""
            self._say(f"probe {number}: running, {seconds:.0f} s; {steps}ranks whose peak is steady: {ranks}")

        try:
            probe = run_probe(
                command, size, folder, self.options.probe_timeout_s, self.options.grace_s, self.secrets,
                self.scratch, progress, self._keeps_microbatches,
            )  # fmt: skip
        except OSError as error:  # the folder: emptied and made before the launch
            raise FitError(f"{folder}: cannot be made an empty probe folder ({error.strerror or error})") from None
        return self._judged(probe, predicted, f"probe {number}")

    def _judged(self, probe: Probe, predicted: list[float] | None, name: str) -> Launch:
        """``probe``'s records read and judged against the limit, said, and kept as the floor or the ceiling."""
        size = probe.micro_batch_size
        run = self._read(probe)
        fits = run is not None and probe.measured and measured_fits(run, self.options.margin)
        launch = Launch(probe, run, predicted, fits)
        self.launches.append(launch)
        measured = ""
        if run is not None and run.nodes:  # judged as the kernel charges the node: its charge against the limit
            node = max(run.nodes, key=lambda node: node.charge_gb / node.limit_gb)
            measured = f"peaks per stage {words.sizes(peaks(run))}; the node's peak charge "
            measured += f"{words.sizes([node.charge_gb])} against its cgroup's limit {words.sizes([node.limit_gb])}; "
        elif run is not None and self.limit is not None:
            measured = f"peaks per stage {words.sizes(peaks(run))} against {words.sizes([self.limit])}; "
        spent = f"{probe.seconds:.0f} s" if probe.launched else f"read from {probe.folder}"
        self._say(f"{name}: micro-batch size {size}: {launch.outcome} ({measured}{spent})")
        if fits:
            if self.best is None or size > self.best.probe.micro_batch_size:
                self.best = launch
        elif launch.outcome == "over the limit" and (self.ceiling is None or size < self.ceiling):
            self.ceiling = size
        return launch

    def _read(self, probe: Probe) -> advice.Profile | None:
        if not probe.folder.is_dir():
            probe.notes.append(f"the command removed its probe folder ({PROBE_DIR_ENV}) while it ran")
            return None
        try:
            run = load(probe.folder, self.options.capacity_gb)
        except AdviseError as error:
            probe.notes.append(str(error))
            return None
        if run.micro_batch_size is not None and run.micro_batch_size != probe.micro_batch_size:
            raise FitError(
                f"the probe launched with micro-batch size {probe.micro_batch_size} recorded "
                f"{run.micro_batch_size}: {PLACEHOLDER} is not where the command takes its micro-batch size"
            )
        run = dataclasses.replace(run, micro_batch_size=probe.micro_batch_size)
        self._check_global_batch(run)
        if self.capacity is None:
            if run.capacity_gb is None:
                raise FitError("no capacity known from the probe's records: give --capacity-gb GB")
            self.capacity, self.capacity_source = run.capacity_gb, run.capacity_source
            self.limit = self.capacity * (1.0 - self.options.margin)
        return dataclasses.replace(run, capacity_gb=self.capacity, capacity_source=self.capacity_source)

    def _keeps_microbatches(self, probe: Probe) -> bool:
        """Whether a later probe's first record already shows the command keeping its microbatches,
        not its global batch (samples per replica unlike the first probe's): the probe is ended there,
        and _check_global_batch says so, without waiting for its measured steps."""
        first = self.launches[0].run if self.launches else None
        expected = _samples(first) if first is not None else None
        if expected is None:
            return False
        for path in probe.folder.glob("rank-*.layers.json"):
            rank = layer_record.rank_of(path.name)
            record = layer_record.read_rank(probe.folder, rank) if rank is not None else None
            facts = (record or {}).get("run") or {}
            microbatches, size = facts.get("microbatches"), facts.get("micro_batch_size")
            if isinstance(microbatches, int) and isinstance(size, int) and microbatches * size != expected:
                return True
        return False

    def _check_global_batch(self, profile: advice.Profile) -> None:
        """FitError where this probe's samples per iteration differ from the first probe's: the
        candidates (and every prediction) hold the global batch fixed."""
        first = self.launches[0].run if self.launches else None
        samples, expected = _samples(profile), _samples(first) if first is not None else None
        if first is None or samples is None or expected is None:
            return
        if samples != expected:
            raise FitError(
                f"the probe at micro-batch size {profile.micro_batch_size} ran {profile.microbatches} microbatches per "
                f"iteration ({samples} samples per replica), the first probe {first.microbatches} of "
                f"{first.micro_batch_size} ({expected}): the command keeps its "
                "microbatches per iteration, not its global batch. fit searches the sizes that keep the global "
                "batch, as Megatron's global_batch_size does: give the command its global batch (the demo's "
                "train.global_batch_size, a Megatron-Bridge recipe's train.global_batch_size)"
            )

    def _next(self) -> int | None:
        """The largest candidate predicted to fit between the floor and the ceiling (every size probed
        is one or the other), by PREDICT_EACH predictions at most (then bisected, as advise's search)."""
        floor = self.best.probe.micro_batch_size if self.best else 0
        low = bisect.bisect_right(self.candidates, floor)
        high = len(self.candidates) if self.ceiling is None else bisect.bisect_left(self.candidates, self.ceiling)
        between = self.candidates[low:high]
        if not between:
            return None
        fitting = self._largest_fitting(between)
        if fitting is not None:
            return fitting
        if self.best is None:  # nothing predicted to fit: the smallest is measured before saying so
            return between[0]
        # The next size up predicted to miss by less than the advice's tested error: measured, not guessed.
        return between[0] if self._fits(between[0], 1.0 + PREDICTION_ERROR) else None

    def _largest_fitting(self, sizes: Sequence[int]) -> int | None:
        """The largest of ``sizes`` (ascending) predicted to fit: each predicted up to PREDICT_EACH;
        above, bisected (a stage's predicted peak grows with the size)."""
        if len(sizes) <= PREDICT_EACH:
            fitting = [size for size in sizes if self._fits(size)]
            return max(fitting) if fitting else None
        if not self._fits(sizes[0]):
            return None
        low, high = 0, len(sizes) - 1  # sizes[low] fits; the last index that does
        while low < high:
            middle = (low + high + 1) // 2
            if self._fits(sizes[middle]):
                low = middle
            else:
                high = middle - 1
        return sizes[low]

    def _fits(self, size: int, slack: float = 1.0) -> bool:
        outcomes = self._outcomes(size)
        return outcomes is not None and all(outcome.fits_with(self.options.margin, slack) for outcome in outcomes)

    def _predicted(self, size: int) -> list[float] | None:
        """Each stage's predicted peak at ``size`` (``_outcomes``)."""
        outcomes = self._outcomes(size)
        return None if outcomes is None else [outcome.peak_gb for outcome in outcomes]

    def _outcomes(self, size: int) -> list[advice.Outcome] | None:
        """Each stage at ``size``: from the measured run nearest in size, its temporaries growing as
        the two measured sizes nearest it show, where there are two."""
        measured = [launch for launch in self.launches if launch.run is not None and launch.probe.measured]
        if not measured:
            return None
        base = min(measured, key=lambda launch: abs(math.log(launch.probe.micro_batch_size / size)))
        assert base.run is not None
        run = dataclasses.replace(base.run, temporaries_growth=_growth(measured, size))
        try:
            return advice.predict(run, advice.parse([f"micro_batch_size={size}"]))
        except advice.Refused:
            return None


def launched(launches: Sequence[Launch]) -> int:
    """How many of ``launches`` fit launched (the run of --from-records, read not launched, is not one)."""
    return sum(1 for launch in launches if launch.probe.launched)


def measured_fits(profile: advice.Profile, margin: float) -> bool:
    """Whether ``run`` as measured left ``margin`` free on every stage: each stage's peak against the
    capacity per rank, or under a shared memory cgroup its node's peak charge against the limit."""
    return all(outcome.fits_with(margin) for outcome in advice.predict(profile, []))


def peaks(profile: advice.Profile) -> list[float]:
    """Each stage's measured peak in ``run`` (its parts' sum: advise's peak today)."""
    return [advice.peak(stage.parts) for stage in profile.stages]


def _samples(profile: advice.Profile) -> int | None:
    """The samples per iteration per data-parallel replica the run's facts give, or None."""
    return (
        profile.microbatches * profile.micro_batch_size if profile.microbatches and profile.micro_batch_size else None
    )


def _candidates(profile: advice.Profile) -> Sequence[int]:
    """The sizes the job allows: with the global batch fixed (the probe's micro-batch size times its
    microbatches, per data-parallel replica), those giving whole microbatches, and under the
    interleaved schedule at least one group of them (Megatron refuses fewer); else 1 to 64x (a
    range: never listed)."""
    if profile.microbatches and profile.micro_batch_size:
        found = advice.divisors(profile.microbatches, profile.micro_batch_size)
        if found is None:
            raise FitError(f"more than {advice.MAX_DIVISORS} sizes divide the samples per iteration: not searched")
        try:
            interleaved = advice.schedule_name(profile) == "interleaved"
        except advice.Refused:
            interleaved = False
        if interleaved:  # Megatron's interleaved schedule takes at least one group of microbatches (PP by default)
            group = profile.microbatch_group or profile.pp_size
            samples = profile.microbatches * profile.micro_batch_size
            found = [size for size in found if samples // size >= group]
        return found
    return range(1, 64 * (profile.micro_batch_size or 1) + 1)


def _growth(measured: list[Launch], size: int) -> tuple[float, ...] | None:
    """Per stage, the temporaries' growth exponent between the two measured sizes nearest ``size``
    (advice.growth_between); None with fewer than two sizes."""
    runs = {launch.probe.micro_batch_size: launch.run for launch in measured if launch.run is not None}
    if len(runs) < 2:
        return None
    near = sorted(sorted(runs, key=lambda s: abs(math.log(s / size)))[:2])
    first, second = runs[near[0]], runs[near[1]]
    assert first is not None and second is not None
    return advice.growth_between(first, second)
