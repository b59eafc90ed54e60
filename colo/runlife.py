"""A run's life: its stop signals, Ray and its cluster, its checkpoints, and how it ends. One context manager spans
colo.launch's whole job, and one table (ENDINGS) says what each exception means: the exit status, whether the
trainers' last trained step is checkpointed on the way out, and whether the cluster may serve another job.

    with RunLife(clusters, debug=args.debug) as life:  # Ctrl-C / SIGTERM stop the run from here on
        life.status = run(...)                        # colo.launch: prepare, the run dir (life.run_dir), colo.loop.run
    return life.status                                # or what ENDINGS gave the exception that ended it

    cluster = life.start_cluster(cfg, plan, run_dir)  # colo.loop: Ray, then the job's actors
    life.job, life.progress = job, bar                # what a failure checkpoints and closes
    life.save(job.schedule.position)                  # checkpoints/step_NNNNNN, the old ones pruned

On the way out, whatever happened: the metrics and rewards closed, the cluster handed back (OwnCluster: its actors,
Ray and their /dev/shm segments stopped; never a hang: a second signal hurries it), the run's logs kept and its run
dir unlocked, the signal handlers restored. A failure report is one line on the terminal (who failed and why, the
checkpoint, how to --resume); the whole traceback (the driver's and, for an actor that raised, the remote one) goes
to <run.dir>/error.log. A checkpoint on the way out is bounded in time: a rank stuck in a collective with a dead
peer must not hang the exit.

Light at import (no torch, Ray or vLLM): a config error ends through the same table before any of them is loaded.
"""
from __future__ import annotations

import errno
import shutil
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from colo.run import commands
from colo.run.logs import died_of, log_of, note_end
from colo.run.rundir import complete_checkpoints
from colo.run.signals import StopSignals

if TYPE_CHECKING:
    from colo.algo.rewards import RewardRunner
    from colo.cluster.actors import Cluster
    from colo.cluster.placement import PlacementPlan
    from colo.config import ColoConfig
    from colo.data.inputs import RunInputs
    from colo.loop import Job
    from colo.rollout.schedule import Position
    from colo.run.metrics import MetricsWriter, ProgressLine

SAVE_ON_FAILURE_S = 900.0  # a DCP save of a 30B model takes minutes; a hung collective takes forever
FULL_BELOW = 64 << 20  # free bytes under which a failed write is put down to a full disk

# ---------------------------------------------------------------------------------------------- how a run ends

SAVE, ENGINE_ONLY, IF_FREE, UNLESS_HURRIED, NOTHING = "save", "engine only", "if free", "unless hurried", "nothing"
STOP_STATUS = -1  # Ending.status of a stop: the signal's own (130 SIGINT, 143 SIGTERM)


@dataclass(frozen=True)
class Ending:
    """How a run ends on one kind of exception."""
    status: int
    """The exit status: 1 a failure, 2 a refusal (nothing ran), STOP_STATUS a stop signal's."""
    checkpoint: str
    """What is saved on the way out. SAVE: the last trained step (the trainers hold a whole policy). ENGINE_ONLY: the
    same when an engine failed, not after a trainer did (its shards may be gone or half-updated, its peers sitting
    in a collective) nor when the node of one is lost. IF_FREE: the same when the trainers are not inside a call
    (the exception's `callers_free`). UNLESS_HURRIED: the same unless a second signal came.
    NOTHING: a refusal, before anything trained."""
    healthy: bool = True
    """The cluster may serve another job (the test suite's warm clusters): False when an actor may be dead, broken or
    still in the call the exception cut short."""
    fix: str = ""
    """A line after the error's own, when the error cannot name the fix itself."""


FAILED = Ending(1, SAVE)
ENDINGS: dict[str, Ending] = {
    # the exception, as module.Class (its subclasses too)   how the run ends
    "colo.config.schema.ConfigError": Ending(2, NOTHING),  # the config: refused before anything started
    "colo.sync.plan.MappingError": Ending(2, NOTHING, fix="a checkpoint of a family colo maps (docs/models.md)"),
    "builtins.KeyboardInterrupt": Ending(STOP_STATUS, UNLESS_HURRIED, healthy=False),  # Ctrl-C, SIGTERM
    "colo.algo.rewards.RewardError": FAILED,  # a reward function raised or hung
    "colo.envs.base.EnvError": FAILED,  # an environment raised (algo.env_errors=fail)
    "colo.loop.TrainingDiverged": FAILED,  # trainer.max_consecutive_skipped non-finite steps in a row
    "colo.cluster.probing.SyncMismatch": FAILED,  # the engines compute other than the trainers after a sync
    "colo.cluster.head.HeadLost": FAILED,  # Ray's head is gone; the trainers' state is still whole
    "builtins.OSError": FAILED,  # the driver's own writes (metrics, logs): a full or vanished disk
    "colo.cluster.actors.ActorDied": Ending(1, ENGINE_ONLY, healthy=False),
    "colo.cluster.actors.ActorError": Ending(1, ENGINE_ONLY, healthy=False),
    "colo.cluster.actors.ActorStalled": Ending(1, IF_FREE, healthy=False),  # stopped or stuck (colo.cluster.liveness)
}
"""Exception -> Ending, the one place a run's ends are decided: a new failure kind is one line here. Named, not
imported, so that this module stays light (tests/unit/test_runlife.py imports each name). An exception none names
ends the run with its traceback, the cluster not reused; so does any but a refusal or a stop before the run dir
exists (there is nothing to report into or save)."""


def ending_of(e: BaseException) -> Ending | None:
    """ENDINGS' entry for e: its class's, else its nearest base class's; None when none is named."""
    for cls in type(e).__mro__:
        ending = ENDINGS.get(f"{cls.__module__}.{cls.__qualname__}")
        if ending is not None:
            return ending
    return None


# ---------------------------------------------------------------------------------------------- the context manager


class Clusters(Protocol):
    """Where a job's cluster comes from and where it goes (colo.launch.main's `clusters`). The product's is
    OwnCluster; a caller that runs jobs in turn in one process may hand another (the test suite's warm clusters,
    tests/warm_clusters.py, reuse the processes of a job of the same shape)."""

    def check(self, cfg: ColoConfig) -> None:
        """ConfigError for a job it cannot run (asked before the run dir is written)."""

    def acquire(self, cfg: ColoConfig, plan: PlacementPlan) -> Cluster:
        """The job's actors, ready (Ray is up)."""

    def release(self, cluster: Cluster | None, healthy: bool, stop: StopSignals) -> None:
        """After the job (`healthy`: every actor alive and trusted); never raises."""


class OwnCluster:
    """Each job starts its own actors and, when it ends, stops them, Ray and their shared memory."""

    def check(self, cfg: ColoConfig) -> None:
        pass

    def acquire(self, cfg: ColoConfig, plan: PlacementPlan) -> Cluster:
        from colo.cluster.actors import start_cluster

        return start_cluster(cfg, plan)

    def release(self, cluster: Cluster | None, healthy: bool, stop: StopSignals) -> None:
        import ray

        from colo.cluster.actors import leave, shutdown_ray
        from colo.host.shm import sweep

        if cluster is not None and ray.is_initialized():
            # best effort, bounded: unlink the trainers' sync buffers and stop vLLM's engine cores (ray.shutdown
            # kills actors without their atexit hooks, which would leave segments in /dev/shm)
            gone = set(cluster.lost)  # actors on a lost node: a call would wait out the timeout
            ends = [a.shutdown.remote() for name, a in cluster.actors() if name not in gone]
            deadline = time.monotonic() + 30
            while ends and time.monotonic() < deadline and not stop.hurry:  # a second signal: stop waiting
                done, ends = ray.wait(ends, num_returns=len(ends), timeout=0.5)
                leave(done)  # read, never dropped: a failed one would print Ray's "Unhandled error" dump
            leave(ends)
        shutdown_ray()  # and what Ray's shutdown leaves running, by pid (colo.host.procs)
        sweep()  # what an actor that did not get to its shutdown left in this host's /dev/shm


class RunLife:
    """The life of one job in this process (module docstring). `clusters`: where its cluster comes from and goes
    (default: its own, OwnCluster); `debug`: a refusal or an early stop shows its traceback instead of one line."""

    def __init__(self, clusters: Clusters | None = None, debug: bool = False) -> None:
        self.clusters: Clusters = clusters or OwnCluster()
        self.debug = debug
        self.stop = StopSignals()
        self.status = 0
        self.run_dir: Path | None = None  # once the run dir is made and locked (colo.materialize): logs kept, unlocked
        self.cluster: Cluster | None = None
        self.job: Job | None = None  # its inputs, writer, rewards and schedule (whose position a failure saves)
        self.progress: ProgressLine | None = None  # the bar on the terminal: closed before a last line
        self._ray_started = False

    def __enter__(self) -> RunLife:
        self.stop.install()
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> bool:
        ending = None if e is None else ending_of(e)
        handled = e is None
        try:
            if e is not None and ending is not None:
                handled = self._end(e, ending)
        finally:
            self._shut_down(healthy=e is None or (handled and ending is not None and ending.healthy))
        return handled and e is not None

    def start_cluster(self, cfg: ColoConfig, plan: PlacementPlan, run_dir: Path) -> Cluster:
        """Ray (the actors' output stays in <run.dir>/logs unless the run is verbose: colo.run.logs), then the job's
        actors from `clusters`."""
        import logging

        from colo.cluster.placement import init_ray
        from colo.run.logs import note_ray_logs

        self._ray_started = True  # from here on the way out hands the cluster back, Ray and all
        init_ray(plan, address=cfg.run.ray_address, log_to_driver=cfg.run.verbose,
                 logging_level=logging.INFO if cfg.run.verbose else logging.ERROR)
        note_ray_logs(run_dir)  # copied into the run dir at its end (colo.run.logs.keep_logs)
        self.stop.install()  # again: ray.init replaced the SIGTERM handler with its own
        self.cluster = self.clusters.acquire(cfg, plan)
        self.stop.install()  # and whatever start-up imported may have too
        return self.cluster

    def save(self, pos: Position) -> Path:
        """A periodic checkpoint of the job's trainers (save), then the old ones pruned to run.keep_checkpoints."""
        from colo.run.rundir import prune_checkpoints

        assert self.job is not None, "save: no job is running"
        path = save(self.job.cluster, self.job.inputs, pos)
        prune_checkpoints(self.job.inputs.run_dir, self.job.cfg.run.keep_checkpoints)  # the newest N, and `keep`s
        return path

    def _position(self) -> Position:
        from colo.rollout.schedule import Position

        return self.job.schedule.position if self.job is not None else Position(-1, {})

    def _end(self, e: BaseException, ending: Ending) -> bool:
        """Report e as `ending` says, saving what it says; sets the status. False: e goes on up, traceback and all."""
        if ending.status == 2:
            if self.debug:
                return False
            what = getattr(e, "cause", None) or e
            print(f"colo: error: {what}" + (f"\nfix: {ending.fix}" if ending.fix else ""), file=sys.stderr, flush=True)
            self.status = 2
        elif ending.status == STOP_STATUS:
            if self.run_dir is None:  # nothing written yet, nothing to save
                if self.debug:
                    return False
                print(f"colo: stopped by {self.stop.name or 'SIGINT'}", file=sys.stderr)
            elif self.job is None:  # the actors were starting: nothing trained
                print(f"colo: stopped by {self.stop.name} during start-up; nothing was trained, nothing saved",
                      file=sys.stderr, flush=True)
            else:
                stopped(self.job.cluster, self.job.inputs, self._position(), self.stop, self.progress)
            self.status = self.stop.exit_status if self.stop.signum else 130
        else:
            if self.job is None:  # before the job's inputs exist: no run to report into
                return False
            keep = ending.checkpoint == SAVE or ending.checkpoint == IF_FREE and getattr(e, "callers_free", False)
            err = e
            if ending.checkpoint == ENGINE_ONLY:
                from colo.cluster.actors import node_loss

                # a lost node is the news, not the actor that noticed it first (a trainer whose gloo peer vanished)
                lost = node_loss(self.job.cluster, e)  # type: ignore[arg-type]
                err, keep = (lost, not lost.trainers) if lost is not None else (e, e.name.startswith("engine"))
            self.status = fail(self.job.cluster, self.job.inputs, self._position(), err, keep_policy=keep,
                               progress=self.progress)
        return True

    def _shut_down(self, healthy: bool) -> None:
        """Close the run's files and hand the cluster back (shut_down), keep its logs and unlock its run dir: never
        raises. Before Ray started (a refusal, a dry run) only the signal handlers are restored."""
        self.stop.closing = True  # a stop signal that arrives now only hurries the cleanup
        try:
            if self._ray_started:
                job = self.job
                shut_down(self.cluster, job.writer if job else None, self.progress, job.rewards if job else None,
                          self.stop, self.clusters, healthy)
            if self.run_dir is not None:
                from colo.run.logs import keep_logs
                from colo.run.rundir import unlock

                # a warm cluster's Ray session is not this run's alone: its logs stay where they are
                keep_logs(self.run_dir, ray_logs=isinstance(self.clusters, OwnCluster))
                unlock(self.run_dir)  # the process may go on to another job (`clusters`)
        finally:
            self.stop.restore()


# ---------------------------------------------------------------------------------------------- checkpoints and reports


def checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (colo.run.rundir.complete_checkpoints: renamed into place)."""
    return complete_checkpoints(run_dir)


def save(c: Cluster, inputs: RunInputs, pos: Position, timeout: float | None = None) -> Path:
    """Checkpoint the trainers as step_NNNNNN: written as step_NNNNNN.tmp and renamed once every rank is done,
    so a save cut off (a full disk, a kill) never leaves a checkpoint that --resume would pick up."""
    path = inputs.run_dir / "checkpoints" / f"step_{pos.step:06d}"
    if (path / "extra.json").exists():  # a failure right after a periodic save: nothing new to write
        return path
    extra: dict[str, Any] = {"step": pos.step, "data": pos.data, "holds": inputs.holds}  # colo.config.runfiles
    if pos.carry is not None:  # loop.mode=async: what the schedule carries into the next step
        extra["async_buffer"] = pos.carry
    tmp = path.with_name(path.name + ".tmp")
    for stale in (tmp, path):  # a save of this step cut off earlier
        shutil.rmtree(stale, ignore_errors=True)
    try:
        c.trainer_group.save_checkpoint(str(tmp), extra, timeout=timeout)
        tmp.rename(path)
    except BaseException as err:
        full = nearly_full(path.parent)  # asked before the half-written files go: they filled it
        shutil.rmtree(tmp, ignore_errors=True)  # half-written: gone, and its space with it
        if full and isinstance(err, Exception):  # torch's writer reports a short write as "unexpected pos"
            raise OSError(errno.ENOSPC, f"No space left on device: saving {path.name} failed "
                                        f"({(str(err).strip().splitlines() or [''])[0]})") from err
        raise
    return path


def nearly_full(path: Path) -> bool:
    try:
        return shutil.disk_usage(path).free < FULL_BELOW
    except OSError:
        return False


def restore(c: Cluster, inputs: RunInputs, writer: MetricsWriter) -> Position | None:
    """Load the newest checkpoint into the trainers; its position (for the schedule's restore), None when there
    is none."""
    if not checkpoints(inputs.run_dir):
        writer.resume_from(-2)  # an earlier attempt that never checkpointed: its records are redone
        return None
    from colo.rollout.schedule import Position

    extra = c.trainer_group.load_checkpoint(str(checkpoints(inputs.run_dir)[-1]))
    writer.resume_from(extra["step"])  # drops records of steps after the checkpoint: they are redone
    return Position(extra["step"], extra["data"], carry=extra.get("async_buffer"))


def fail(c: Cluster, inputs: RunInputs, pos: Position, e: Exception, keep_policy: bool,
         progress: ProgressLine | None = None) -> int:
    """Report a run-ending failure, checkpointing the trainers when they still hold a whole policy; status 1."""
    if progress:  # ends the bar's line: the error starts a line of its own
        progress.close()
    full = disk_full(e)
    try:
        where = f"traceback: {log_error(inputs.run_dir, e)}"
    except OSError as err:  # the disk that ended the run cannot take the traceback either
        where = f"traceback not written: {err.strerror or err}"
    from colo.cluster.actors import ActorDied  # Ray is up by now: a failure of a running job

    actor_log = log_of(inputs.run_dir, getattr(e, "name", ""))  # ActorDied / ActorError name the actor
    what = (f"the disk of {inputs.run_dir} is full ({e}); fix: free space there, then continue the run"
            if full else str(e) + (died_of(actor_log) if isinstance(e, ActorDied) else ""))
    lines = [f"colo: error: {what} ({where}" + (f"; its log: {actor_log})" if actor_log else ")")]
    if keep_policy and pos.step >= 0 and not full:  # a full disk would only fail the save a second time
        try:  # bounded: a rank stuck in a collective with a dead peer must not hang the exit
            save(c, inputs, pos, timeout=SAVE_ON_FAILURE_S)
        except Exception as err:  # noqa: BLE001 (report and exit; the periodic checkpoints remain)
            lines.append(f"colo: could not checkpoint step {pos.step}: {type(err).__name__}: {err}")
    if checkpoints(inputs.run_dir):
        lines.append(f"colo: newest checkpoint {checkpoints(inputs.run_dir)[-1]}; "
                     f"continue with: {commands.resume(inputs.run_dir)}")
    print("\n".join(lines), file=sys.stderr, flush=True)
    return 1


def log_error(run_dir: Path, e: Exception) -> Path:
    """Append the failure's full traceback to <run_dir>/error.log (earlier failures of the run stay)."""
    path = run_dir / "error.log"
    text = "".join(traceback.format_exception(e))  # the chain: an actor's RayTaskError holds its remote traceback
    with path.open("a") as f:
        f.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} colo: error: {e}\n{text}\n")
    return path


def disk_full(e: BaseException) -> bool:
    """ENOSPC anywhere in the failure: the driver's own OSError, or an actor's (inside a DCP CheckpointException)."""
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return True
    return "No space left on device" in "".join(traceback.format_exception(e))


def stopped(c: Cluster, inputs: RunInputs, pos: Position, stop: StopSignals, progress: ProgressLine | None) -> int:
    """A stop signal: checkpoint the last finished step (unless a second signal asks for haste), then one line
    saying what was saved and how to continue; the exit status is 130 (SIGINT) or 143 (SIGTERM)."""
    if progress:
        progress.close()
    hint = f"continue with: {commands.resume(inputs.run_dir)}"
    saved = None
    if pos.step >= 0 and not stop.hurry:
        try:
            saved = save(c, inputs, pos, timeout=SAVE_ON_FAILURE_S)
        except KeyboardInterrupt:  # a second Ctrl-C during the save: exit at once, nothing half-written kept
            pass
        except Exception as err:  # noqa: BLE001 (report and exit; the periodic checkpoints remain)
            print(f"colo: could not checkpoint step {pos.step}: {type(err).__name__}: {err}", file=sys.stderr)
    newest = checkpoints(inputs.run_dir)[-1] if checkpoints(inputs.run_dir) else None
    if saved is not None:
        what = f"saved step {pos.step} in {saved}"
    elif newest is not None:
        what = (f"step {pos.step} not saved (second signal)" if pos.step >= 0 else "no RL step finished") + \
               f"; newest checkpoint {newest}"
    else:
        what = "no RL step finished yet, nothing saved" if pos.step < 0 else f"step {pos.step} not saved"
    line = f"colo: stopped by {stop.name}: {what}; {hint}"
    print(line, file=sys.stderr, flush=True)
    note_end(inputs.run_dir, line)  # SIGHUP: the terminal that shows the line is gone
    return stop.exit_status


def shut_down(cluster: Cluster | None, writer: MetricsWriter | None, progress: ProgressLine | None,
              rewards: RewardRunner | None, stop: StopSignals, clusters: Clusters, healthy: bool = True) -> None:
    """Close the run's files and hand the cluster back (OwnCluster: its actors, Ray and their shared memory
    stopped); never raises, and every step runs even when one fails (a full disk fails metrics.png). A stop
    signal that arrives now only hurries it."""
    stop.closing = True  # no KeyboardInterrupt in the middle of the cleanup: a second signal only shortens the wait
    try:
        if writer is not None:
            try:
                writer.close()  # metrics.png: on a full disk this fails too
            except OSError:
                pass
        if progress:
            progress.close()
        if rewards is not None:
            rewards.close()
        try:
            clusters.release(cluster, healthy, stop)
        except Exception as err:  # noqa: BLE001 (the job's outcome stands)
            print(f"colo: could not release the cluster: {err}", file=sys.stderr)
    finally:
        stop.restore()
