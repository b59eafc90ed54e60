"""A run's life around its steps (colo.loop.run): where its cluster comes from and goes, its checkpoints, and
how it ends when something fails or a signal stops it.

    pos = restore(cluster, inputs, writer)          # --resume: the newest complete checkpoint, or None
    save(cluster, inputs, schedule.position)        # checkpoints/step_NNNNNN (written .tmp, renamed when whole)
    status = fail(cluster, inputs, pos, e, keep_policy=True)     # one `colo: error:` line, status 1
    status = stopped(cluster, inputs, pos, stop, progress)       # Ctrl-C / SIGTERM: 130 / 143
    shut_down(cluster, writer, progress, rewards, stop, clusters)

A failure report is one line on the terminal (who failed and why, the checkpoint, how to --resume); the whole
traceback (the driver's and, for an actor that raised, the remote one) goes to <run.dir>/error.log. The trainers
are checkpointed on the way out when they still hold a whole policy, bounded in time: a rank stuck in a
collective with a dead peer must not hang the exit.
"""
from __future__ import annotations

import errno
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import ray

from colo.cluster.actors import ActorDied, Cluster, leave, shutdown_ray, start_cluster
from colo.host.shm import sweep
from colo.run import commands
from colo.run.logs import died_of, log_of, note_end
from colo.run.rundir import complete_checkpoints
from colo.rollout.schedule import Position

if TYPE_CHECKING:
    from colo.algo.rewards import RewardRunner
    from colo.cluster.placement import PlacementPlan
    from colo.config import ColoConfig
    from colo.data.inputs import RunInputs
    from colo.run.metrics import MetricsWriter, ProgressLine
    from colo.run.signals import StopSignals

SAVE_ON_FAILURE_S = 900.0  # a DCP save of a 30B model takes minutes; a hung collective takes forever
FULL_BELOW = 64 << 20  # free bytes under which a failed write is put down to a full disk


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
        return start_cluster(cfg, plan)

    def release(self, cluster: Cluster | None, healthy: bool, stop: StopSignals) -> None:
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
