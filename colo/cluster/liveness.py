"""Is an actor slow, stopped or stuck? A heartbeat and deadlines from measured call times, for every wait of the
driver on its trainers and engines (colo.cluster.actors.gather).

    live = Liveness(heartbeat_s=60, stall_s=600)       # run.heartbeat_s, run.stall_s; one per cluster
    watch = live.watch("train_step", [("trainer rank 0", t0), ...])
    ...                                                # every ping_every_s (PING_EVERY_S) of waiting:
    problem = watch.check(pending=["trainer rank 1"])  # None, or Stalled(names, why, callers_free)
    live.measured("train_step", seconds)               # a call that returned: the deadline of its kind grows

- **Stopped** (a SIGSTOP, a frozen host or VM, a process that holds Python's GIL): the actor answers no heartbeat
  for run.heartbeat_s. A heartbeat is a tiny call in a concurrency group of its own (HEARTBEAT_GROUP, declared by
  colo.cluster.actors.start_cluster), so it runs on another thread of the actor while its main thread is busy:
  a long call answers, a stopped process does not. The engines a trainer talks to in the sync are watched too.
- **Stuck** (a hung CUDA kernel or NCCL collective, a deadlock): the actor answers heartbeats but the call has not
  returned long after calls of its kind did: its deadline is max(run.stall_s, FACTOR x the longest such call so far),
  UNMEASURED x run.stall_s for a kind not yet measured. Slow calls (a longer rollout, a loaded host) stay within it.

Without them a stopped engine makes the run wait without a word, for ever.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import ray

HEARTBEAT_GROUP = "colo-heartbeat"  # the actors' concurrency group for heartbeats: one thread beside the main one
PING_EVERY_S = 5.0  # how often a waiting driver checks (a heartbeat costs ~1 ms of the actor's time)
FACTOR = 10.0  # a call may take this many times the longest of its kind so far (the deadline's measured part)
UNMEASURED = 3.0  # x run.stall_s: the deadline of a call whose kind has not been measured yet (the first of it)
ENGINE_CALLS = frozenset({"generate", "probe", "sleep", "wake_up"})  # the trainers are idle meanwhile


def _pid(actor: Any) -> int:
    """The heartbeat: runs on the actor (colo.cluster.actors sends it through __ray_call__ into HEARTBEAT_GROUP)."""
    return os.getpid()


@dataclass
class Stalled:
    names: list[str]  # the actors that stopped or are stuck
    why: str  # one clause: what was seen
    callers_free: bool  # the trainers are not inside a call (they can still save the policy)


@dataclass
class Liveness:
    heartbeat_s: float = 60.0
    stall_s: float = 600.0
    ping_every_s: float = PING_EVERY_S  # how often a wait checks (tests check more often)
    longest: dict[str, float] = field(default_factory=dict)  # call kind -> the longest such call that returned
    lost: list[str] = field(default_factory=list)  # names of actors found stopped or stuck (the cluster's `lost`)
    pids: dict[str, int] = field(default_factory=dict)  # actor name -> its process id, as its heartbeats say
    watched: set[str] = field(default_factory=set)  # the actors made with HEARTBEAT_GROUP (note_pids): only they
    # are sent heartbeats, since a call into a concurrency group an actor lacks kills its worker process
    _pings: dict[str, tuple[Any, float]] = field(default_factory=dict)  # actor name -> (heartbeat ref, sent at)

    def deadline(self, kind: str) -> float:
        longest = self.longest.get(kind)
        return UNMEASURED * self.stall_s if longest is None else max(self.stall_s, FACTOR * longest)

    def measured(self, kind: str, seconds: float) -> None:
        self.longest[kind] = max(seconds, self.longest.get(kind, 0.0))

    def watch(self, kind: str, actors: list[tuple[str, Any]]) -> Watch:
        return Watch(self, kind, actors, time.monotonic())

    def note_pids(self, actors: list[tuple[str, Any]], timeout_s: float = 60.0) -> None:
        """One heartbeat to each actor of a cluster that just started (made with HEARTBEAT_GROUP: from now on they are
        watched): its pid, by which a stopped one is killed at the end (a stopped process takes no part in its own
        shutdown)."""
        self.watched |= {name for name, _ in actors}
        refs = {name: actor.__ray_call__.options(concurrency_group=HEARTBEAT_GROUP).remote(_pid)
                for name, actor in actors}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        for name, ref in refs.items():
            if ray.wait([ref], timeout=0)[0]:
                pid = _read(ref)
                if pid is not None:
                    self.pids[name] = pid
            else:
                self._pings[name] = (ref, time.monotonic())

    def unanswered(self, actors: list[tuple[str, Any]]) -> tuple[str, float] | None:
        """Send a heartbeat to each actor that has none outstanding; (name, seconds) of the first whose heartbeat has
        been unanswered for heartbeat_s."""
        now = time.monotonic()
        for name, actor in actors:
            if name not in self.watched:
                continue
            if name in self._pings:
                ref, sent = self._pings[name]
                done, _ = ray.wait([ref], timeout=0)
                if not done:
                    if now - sent >= self.heartbeat_s:
                        return name, now - sent
                    continue
                pid = _read(ref)
                if pid is not None:
                    self.pids[name] = pid
            ref = actor.__ray_call__.options(concurrency_group=HEARTBEAT_GROUP).remote(_pid)
            self._pings[name] = (ref, now)
        return None


def _read(ref: Any) -> int | None:
    """An answered heartbeat's pid; a dead actor's error is read (Ray would print it unread), and dropped: the call
    the driver waits for reports the death."""
    try:
        return ray.get(ref, timeout=0)
    except Exception:  # noqa: BLE001
        return None


@dataclass
class Watch:
    """One wait: its kind, the actors it depends on (the callees, and the engines a sync writes), when it began."""

    live: Liveness
    kind: str
    actors: list[tuple[str, Any]]
    started: float

    def check(self, pending: list[str]) -> Stalled | None:
        stopped = self.live.unanswered(self.actors)
        callers_free = self.kind in ENGINE_CALLS
        if stopped is not None:
            name, seconds = stopped
            self.live.lost.append(name)
            return Stalled([name], f"answered no heartbeat for {seconds:.0f} s while the driver waited for its "
                                   f"{self.kind} (a stopped process: SIGSTOP, a frozen host, or one that holds "
                                   f"Python's GIL; run.heartbeat_s={self.live.heartbeat_s:g})", callers_free)
        elapsed, limit = time.monotonic() - self.started, self.live.deadline(self.kind)
        if elapsed < limit:
            return None
        self.live.lost.extend(pending)
        longest = self.live.longest.get(self.kind)
        bound = (f"{FACTOR:g}x the longest {self.kind} so far ({longest:.1f} s)" if longest is not None and
                 FACTOR * longest > self.live.stall_s else
                 f"run.stall_s={self.live.stall_s:g}" + ("" if longest is not None else
                                                          f" x {UNMEASURED:g}: the first {self.kind} of the run"))
        who = "it answers" if len(pending) == 1 else "they answer"
        return Stalled(pending, f"did not return from {self.kind} in {elapsed:.0f} s ({bound}), though {who} "
                                "heartbeats: stuck (a hung CUDA kernel or collective, a deadlock)", callers_free)
