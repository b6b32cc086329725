"""Reward-hacking guards: the alarms an evaluation or a proxy-fidelity check raises, and when a campaign stops.

A training reward can be gamed (DESIGN 5): the evaluator keeps rising while the samples lose variety or grow a
texture at the transformer's patch period. Each alarm compares one measure with the starting policy's
(iteration 0) or with a bound:

- ``diversity``: the evaluation's sample diversity below ``campaign.guard_diversity`` x the start's;
- ``grid_energy``: the spectral power on the patch-period lattice above ``campaign.guard_grid_factor`` x the
  start's and above ``campaign.guard_grid_min``;
- ``temporal``: for videos, the evaluation's frame-to-frame change above ``campaign.guard_temporal_factor`` x the
  start's (a per-frame reward gamed with flicker);
- ``proxy_fidelity``: the kept seeds' explore/BF16 Spearman rho below ``fidelity.min_spearman`` at any
  iteration since the previous evaluation.

Alarms are computed from the committed manifests' metrics alone, so a resumed campaign reaches the same
verdict as the uninterrupted one. ``campaign.on_guard=stop`` ends the campaign once one measure has alarmed at
``campaign.guard_patience`` evaluations in a row (``guard_trip``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from solrl.config import CampaignConfig, ConfigError, RunConfig
from solrl.storage.artifacts import EvalSamples
from solrl.storage.runs import Run, pass_guard, solrl_command
from solrl.storage.stage import read_manifest

#: Exit code of ``solrl run`` / ``resume`` when ``campaign.on_guard=stop`` ended the campaign.
GUARD_STOP_EXIT = 3


@dataclass(frozen=True)
class Alarm:
    """One measure out of bounds at one iteration."""

    measure: str  # diversity | grid_energy | temporal | proxy_fidelity
    iteration: int
    value: float
    bound: float  # the value past which the alarm fires
    message: str  # what is wrong, by how much, and where to look


def _percent(fraction: float) -> str:
    """``fraction`` as a percentage to 3 significant figures: a 0.18% drop is not "0%", nor a bound of 0.999
    "100%"."""
    return f"{100 * fraction:.3g}%"


def evaluation_alarms(
    metrics: dict[str, float],
    start: dict[str, float] | None,
    iteration: int,
    bounds: CampaignConfig,
    period: int | None = None,
) -> list[Alarm]:
    """The alarms of an evaluation's metrics (``eval/diversity``, ``eval/grid_energy``, and for videos
    ``eval/temporal_change``) against the starting policy's evaluation ``start`` (None at iteration 0: no alarm),
    with the bounds ``campaign.guard_*`` of ``bounds``; ``period`` the patch period in pixels, named in the grid
    alarm's message."""
    if start is None:
        return []
    alarms = []
    diversity, diversity_start = metrics.get("eval/diversity"), start.get("eval/diversity")
    if diversity is not None and diversity_start:
        bound = bounds.guard_diversity * diversity_start
        if diversity < bound:
            alarms.append(
                Alarm(
                    "diversity",
                    iteration,
                    diversity,
                    bound,
                    f"sample diversity {diversity:.4f} is {_percent(1 - diversity / diversity_start)} below the "
                    f"starting policy's {diversity_start:.4f} (alarm below {_percent(bounds.guard_diversity)} of it, "
                    f"{bound:.4f}): "
                    f"the training reward may be gamed; look at {EvalSamples.grid} and the other rewards",
                )
            )
    grid, grid_start = metrics.get("eval/grid_energy"), start.get("eval/grid_energy")
    if grid is not None and grid_start:
        bound = max(bounds.guard_grid_factor * grid_start, bounds.guard_grid_min)
        if grid > bound:
            texture = f"a texture at the {period}-pixel patch period" if period else "a texture at the patch period"
            alarms.append(
                Alarm(
                    "grid_energy",
                    iteration,
                    grid,
                    bound,
                    f"grid-artifact energy {grid:.4f} is {grid / grid_start:.1f}x the starting policy's "
                    f"{grid_start:.5f} (alarm above {bounds.guard_grid_factor:g}x it and {bounds.guard_grid_min:g}): "
                    f"the policy may be learning {texture}; look at {EvalSamples.grid}",
                )
            )
    change, change_start = metrics.get("eval/temporal_change"), start.get("eval/temporal_change")
    if change is not None and change_start:
        bound = bounds.guard_temporal_factor * change_start
        if change > bound:
            alarms.append(
                Alarm(
                    "temporal",
                    iteration,
                    change,
                    bound,
                    f"temporal change (frame to frame) {change:.4f} is {change / change_start:.1f}x the starting "
                    f"policy's {change_start:.4f} (alarm above {bounds.guard_temporal_factor:g}x it): the videos may "
                    f"flicker to game a per-frame reward; look at {EvalSamples.grid}",
                )
            )
    return alarms


def fidelity_alarm(metrics: dict[str, float], min_spearman: float | None, iteration: int) -> Alarm | None:
    """The proxy-fidelity alarm of a score_regenerate stage's metrics (None: within bounds, or no bound set)."""
    rho = metrics.get("fidelity/spearman")
    if min_spearman is None or rho is None or rho >= min_spearman:
        return None
    return Alarm(
        "proxy_fidelity",
        iteration,
        rho,
        min_spearman,
        f"proxy fidelity Spearman {rho:.3f} is below fidelity.min_spearman={min_spearman}: the explore copy no "
        f"longer ranks the pool as the BF16 policy does",
    )


@dataclass(frozen=True)
class GuardTrip:
    """A measure that alarmed at ``campaign.guard_patience`` evaluations in a row."""

    measure: str
    alarms: list[Alarm]  # one per evaluation of the streak, oldest first
    last_good: int  # the last evaluated iteration before the streak (0: the starting policy, no checkpoint)
    patience: int
    evaluated: list[int]  # the streak's evaluated iterations
    last_good_passed: bool = False  # last_good is a guard stop the user passed (solrl resume --past-guard)

    @property
    def iteration(self) -> int:
        """The iteration whose evaluation completed the streak: the campaign ends after its checkpoint."""
        return self.evaluated[-1]

    def message(self, run_id: str, store: str) -> str:
        """What tripped, by how much, where the campaign stopped and which checkpoint to export."""
        where = ", ".join(str(i) for i in self.evaluated)
        if self.last_good == 0:
            export = "the last policy before it is the starting policy (iteration 0, no checkpoint to export)"
        else:
            passed = " (itself a guard stop, passed with --past-guard)" if self.last_good_passed else ""
            export = (
                f"the last checkpoint before it is iteration {self.last_good}{passed}: "
                f"`{solrl_command('export', run_id, '--iteration', self.last_good, '--store', store)}`"
            )
        passing = solrl_command("resume", run_id, "--store", store, "--past-guard")
        return (
            f"guard stop (campaign.on_guard=stop): {self.measure} alarmed at {len(self.alarms)} evaluation(s) in a row "
            f"(iteration {where}; campaign.guard_patience={self.patience}): {self.alarms[-1].message}. The campaign "
            f"ended at iteration {self.iteration}'s checkpoint; {export}. To continue after a look: `{passing}`"
        )


def iteration_alarms(run_dir: Path, cfg: RunConfig, up_to: int) -> dict[int, list[Alarm]]:
    """The alarms of every evaluated iteration ``1..up_to`` with a committed evaluation, in order: its own
    evaluation's, plus a proxy-fidelity alarm of any iteration since the previous evaluation."""
    start_manifest = read_manifest(run_dir, 0, "evaluate")
    start = start_manifest.metrics if start_manifest is not None else None
    found: dict[int, list[Alarm]] = {}
    fidelity: list[Alarm] = []
    for iteration in range(1, up_to + 1):
        scored = read_manifest(run_dir, iteration, "score_regenerate")
        if scored is not None and (alarm := fidelity_alarm(scored.metrics, cfg.fidelity.min_spearman, iteration)):
            fidelity.append(alarm)
        evaluated = read_manifest(run_dir, iteration, "evaluate")
        if evaluated is None:
            continue
        period = evaluated.info.get("grid_period")
        found[iteration] = evaluation_alarms(evaluated.metrics, start, iteration, cfg.campaign, period) + fidelity[-1:]
        fidelity = []
    return found


def guard_trip(run_dir: Path, cfg: RunConfig, up_to: int, passed: tuple[int, ...] = ()) -> GuardTrip | None:
    """The first measure that alarmed at ``campaign.guard_patience`` consecutive evaluations among iterations
    ``1..up_to`` (None: none did). Ties at one evaluation go to the measure named first in the alarms. ``passed``:
    iterations whose guard stop the user let pass (``Run.guards_passed``): a streak that ends at one of them does
    not stop the campaign, and every streak starts again from nothing after it. An iteration of ``passed`` where no
    streak ended passes nothing."""
    patience = cfg.campaign.guard_patience
    streaks: dict[str, list[tuple[int, Alarm]]] = {}  # measure -> (evaluated iteration, its alarm), in a row
    evaluated = [0]
    passed_stops: set[int] = set()  # the iterations of ``passed`` where a streak did end
    for iteration, alarms in iteration_alarms(run_dir, cfg, up_to).items():
        # a measure not alarmed at this evaluation starts again from nothing
        streaks = {a.measure: [*streaks.get(a.measure, []), (iteration, a)] for a in alarms}
        evaluated.append(iteration)
        tripped = next((m for m, streak in streaks.items() if len(streak) >= patience), None)
        if tripped is None:
            continue
        if iteration in passed:  # the user looked and let it go on: later evaluations start new streaks
            streaks = {}
            passed_stops.add(iteration)
            continue
        streak = streaks[tripped][-patience:]
        before = evaluated[evaluated.index(streak[0][0]) - 1]
        return GuardTrip(
            tripped, [a for _, a in streak], before, patience, [i for i, _ in streak], before in passed_stops
        )
    return None


def run_guard_trip(run: Run) -> GuardTrip | None:
    """The guard streak that ends ``run``'s campaign under ``campaign.on_guard=stop``, its passed stops
    (``Run.guards_passed``) let pass; None when none does, or the run does not stop at guards."""
    if run.config.campaign.on_guard != "stop":
        return None
    return guard_trip(run.run_dir, run.config, run.config.campaign.iterations, run.guards_passed)


def pass_guard_stop(run: Run) -> GuardTrip:
    """Let ``run`` go on past the guard stop that ended its campaign (``solrl resume --past-guard``, the
    deployment's ``past_guard``): record its iteration in ``run.json`` (``storage.runs.pass_guard``; the caller
    holds the run's lease) and return it.

    Raises:
        ConfigError: the run is complete, or no guard stop ends it (the message names the stops already passed).
    """
    trip = run_guard_trip(run)
    if trip is None:
        if read_manifest(run.run_dir, run.config.campaign.iterations, "evaluate") is not None:
            raise ConfigError(f"run {run.run_id} is complete; there is no guard stop to pass")
        passed = ", ".join(map(str, run.guards_passed))
        raise ConfigError(
            f"run {run.run_id} is not stopped by a guard (campaign.on_guard={run.config.campaign.on_guard}"
            + (f"; its stops at iteration(s) {passed} are passed already" if passed else "")
            + "); continue it without passing a guard"
        )
    pass_guard(run, trip.iteration)
    return trip


def evaluation_summary(run_dir: Path, up_to: int) -> str | None:
    """One line: the last committed evaluation among iterations ``1..up_to`` against the starting policy's, every
    evaluated reward, then sample diversity (change) and grid energy (multiple), the guards' measures. None
    before a second evaluation exists."""
    start = read_manifest(run_dir, 0, "evaluate")
    found = ((i, read_manifest(run_dir, i, "evaluate")) for i in range(up_to, 0, -1))
    last, now = next(((i, m) for i, m in found if m is not None), (None, None))
    if start is None or now is None:
        return None
    parts = []
    for key, value in now.metrics.items():
        if not key.startswith("eval/") or key in ("eval/diversity", "eval/grid_energy", "eval/temporal_change"):
            continue
        before = start.metrics.get(key)
        parts.append(f"{key[5:]} {value:.3f}" + (f" (start {before:.3f})" if before is not None else ""))
    diversity, diversity_start = now.metrics.get("eval/diversity"), start.metrics.get("eval/diversity")
    if diversity is not None and diversity_start:
        change = diversity / diversity_start - 1
        relative = f"{change:+.0%}" if round(change, 2) else "±0%"  # not "-0%"
        parts.append(f"diversity {diversity:.3f} ({relative} vs start)")
    grid, grid_start = now.metrics.get("eval/grid_energy"), start.metrics.get("eval/grid_energy")
    if grid is not None and grid_start:
        parts.append(f"grid energy {grid:.5f} ({grid / grid_start:.1f}x start)")
    change, change_start = now.metrics.get("eval/temporal_change"), start.metrics.get("eval/temporal_change")
    if change is not None and change_start:
        parts.append(f"temporal change {change:.4f} ({change / change_start:.1f}x start)")
    return f"iteration {last}: " + ", ".join(parts)
