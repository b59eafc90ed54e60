"""A Ray cluster of two nodes on this one machine, with two IP addresses, for the multi-node tests.

    with TwoNodes(head_gpus=1, worker_gpus=1) as c:   # c.address: "10.77.x.1:<port>" for run.ray_address
        c.kill_worker_raylet()                        # the worker node dies (its raylet, by the pid we hold)
        c.start_worker()                              # a fresh worker node joins: the cluster is re-formed

Preferred (root): the worker node lives in a network namespace of its own, joined to the host by a veth
pair (host side 10.77.N.1, namespace side 10.77.N.2). The namespace has its own loopback, so anything on the
worker node that dials 127.0.0.1 for a peer on the head (or a gloo socket bound to the loopback) fails, as
it would across two hosts. Fallback (no root, no `ip netns`): the head on 127.0.0.1 and a second raylet
with --node-ip-address 127.0.0.2. That one shares the host's loopback, so it cannot catch a hard-coded
127.0.0.1; `kind` says which was used and the test prints it.

Teardown stops exactly what this object started: the `ray start --block` processes it spawned and their
children (by pid), then the namespace and the veth by the names it created. Ray's own `ray stop` is not
used: it kills every Ray process on the machine, other tests' and other users' too.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from colo.host.net import free_port

RAY = str(Path(sys.executable).with_name("ray"))
SCRIPT = str(Path(__file__).resolve().parents[2] / "launch" / "ray-cluster.sh")  # the README's node starter
# Node death is noticed by the GCS health check; Ray's defaults take ~30 s, too slow for a test. A killed raylet
# refuses the check at once, so 5 checks 0.5 s apart find it in ~3 s; a live one has 5 s to answer each: with 1 s
# and 3 checks (until 2026-11-26) the fresh worker node of a loaded 2-core machine missed them and was declared
# dead during the resume (the suite's run at 12:00, trainer rank 1 "died because its node has died").
FAST_HEALTH = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "5000",
               "RAY_health_check_failure_threshold": "5", "RAY_health_check_initial_delay_ms": "1000"}

# The driver TwoNodes.alive_nodes asks: connects once, then answers each line on stdin with the alive nodes' IPs.
WATCH = """
import json, sys
import ray
ray.init(address=sys.argv[1], logging_level="ERROR")
for _ in sys.stdin:
    print("alive: " + json.dumps([n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]), flush=True)
"""


def _netns_works() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    name = f"colo-probe-{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return ok


class TwoNodes:
    """Head node (driver side) + one worker node with a different IP address; see the module docstring."""

    def __init__(self, head_gpus: int, worker_gpus: int, cpus: int = 4, env: dict[str, str] | None = None):
        self.head_gpus, self.worker_gpus, self.cpus = head_gpus, worker_gpus, cpus
        # Ray 2.60 clusters started by `ray start` require a token from every client; one of our own,
        # handed to the nodes and to the drivers (client_env), keeps a user's ~/.ray/auth_token out of it
        self.client_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self.env = {**os.environ, **FAST_HEALTH, **self.client_env, **(env or {})}
        self.env.pop("RAY_ADDRESS", None)
        self.tag = f"{os.getpid() % 10000}{int(time.time()) % 100:02d}"  # short: veth names max 15 chars
        self.kind = "netns" if _netns_works() else "loopback-alias"
        self.ns = self.veth = None
        self.procs: list[subprocess.Popen] = []
        self.worker: subprocess.Popen | None = None
        self.watcher: subprocess.Popen | None = None  # the driver alive_nodes asks through
        self._noted: dict[int, float] = {}  # pid -> create time of processes seen in our nodes' trees
        # short: Ray's unix socket paths under it must stay within 107 bytes
        self.tmp = Path(tempfile.mkdtemp(prefix="cmn", dir="/tmp"))
        self.keep_logs = False  # a start that failed keeps its nodes' logs (its error names them)

    # ---------------------------------------------------------------------------------------- network
    def _net_up(self) -> None:
        if self.kind != "netns":
            self.head_ip, self.worker_ip = "127.0.0.1", "127.0.0.2"
            return
        subnet = 200 + os.getpid() % 50  # two test sessions at once get different subnets (mostly)
        self.head_ip, self.worker_ip = f"10.77.{subnet}.1", f"10.77.{subnet}.2"
        self.ns, self.veth = f"colo-{self.tag}", f"cv{self.tag}"
        cmds = [["ip", "netns", "add", self.ns],
                ["ip", "link", "add", self.veth, "type", "veth", "peer", "name", f"{self.veth}p"],
                ["ip", "link", "set", f"{self.veth}p", "netns", self.ns],
                ["ip", "addr", "add", f"{self.head_ip}/24", "dev", self.veth],
                ["ip", "link", "set", self.veth, "up"],
                ["ip", "netns", "exec", self.ns, "ip", "addr", "add", f"{self.worker_ip}/24", "dev", f"{self.veth}p"],
                ["ip", "netns", "exec", self.ns, "ip", "link", "set", f"{self.veth}p", "up"],
                ["ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up"]]
        for cmd in cmds:
            subprocess.run(cmd, check=True, capture_output=True)

    def _net_down(self) -> None:
        if self.veth:
            subprocess.run(["ip", "link", "delete", self.veth], capture_output=True)  # takes its peer along
        if self.ns:
            subprocess.run(["ip", "netns", "delete", self.ns], capture_output=True)

    # ------------------------------------------------------------------------------------------ nodes
    def _spawn(self, cmd: list[str], log: str, **env: str) -> subprocess.Popen:
        self._log = self.tmp / log  # what _wait_nodes reads: this spawn's lines, after what the log held before
        self._log_from = self._log.stat().st_size if self._log.exists() else 0
        out = open(self.tmp / log, "ab")
        p = subprocess.Popen(cmd, env={**self.env, **env}, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.procs.append(p)
        return p

    def start(self) -> "TwoNodes":
        self._net_up()
        self.port = free_port()  # below the ephemeral range, as the product's rendezvous ports
        self.address = f"{self.head_ip}:{self.port}"
        # the script execs `ray start --block`: the pid we hold is Ray's, its children the node's processes
        self._spawn(["bash", SCRIPT, "head"], "head.log", RAY_BIN=RAY, BLOCK="1", DASHBOARD="0",
                    NODE_IP=self.head_ip, RAY_PORT=str(self.port), NUM_CPUS=str(self.cpus),
                    NUM_GPUS=str(self.head_gpus), RAY_TMPDIR=str(self.tmp))
        self._wait_nodes(1)
        self.start_worker()
        return self

    def start_worker(self) -> None:
        cmd = ["bash", SCRIPT, "worker", self.address]
        if self.ns:  # `ip netns exec` execs its command too: still one process, Ray's
            cmd = ["ip", "netns", "exec", self.ns, *cmd]
        self.worker = self._spawn(cmd, "worker.log", RAY_BIN=RAY, BLOCK="1", NODE_IP=self.worker_ip,
                                  NUM_CPUS=str(self.cpus), NUM_GPUS=str(self.worker_gpus))
        self._wait_nodes(2)

    def alive_nodes(self) -> list[str]:
        """IP addresses of the nodes the GCS counts alive, asked through one driver process that stays connected
        (WATCH): a throwaway driver per question cost ~2.5 CPU-s each (Python, Ray's import, a job of its own),
        and the waits below ask about ten times per module. [] while the head's GCS does not answer."""
        import json
        import select

        if self.watcher is None or self.watcher.poll() is not None:
            self.watcher = subprocess.Popen([sys.executable, "-c", WATCH, self.address], env=self.env, text=True,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            self.watcher.stdin.write("?\n")
            self.watcher.stdin.flush()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if not select.select([self.watcher.stdout], [], [], deadline - time.monotonic())[0]:
                    break
                line = self.watcher.stdout.readline()
                if not line:  # it exited: no GCS to connect to yet (the next question starts another)
                    break
                if line.startswith("alive: "):  # Ray may print lines of its own around it
                    return json.loads(line[len("alive: "):])
        except (BrokenPipeError, OSError):
            pass
        self._stop_watcher()
        return []

    def _stop_watcher(self) -> None:
        if self.watcher is not None:
            self.watcher.kill()
            self.watcher.wait()
            self.watcher = None

    def _wait_nodes(self, n: int, timeout: float = 300) -> None:
        """Until the GCS counts n nodes alive; the node just spawned has said "Ray runtime started." in its log
        first (read, not asked: the GCS is asked once it is worth asking). 300 s: alone a node is up in ~10 s, but in
        the full suite on a loaded 2-core machine 90 s were seen to pass without it (the suite on an Intel Xeon,
        2026-11-28); a node that gave up ends the wait at once, so only a slow start waits longer."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and all(p.poll() is None for p in self.procs):
            with open(self._log, "rb") as f:
                f.seek(self._log_from)
                if b"Ray runtime started." in f.read():
                    break
            time.sleep(0.2)
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                break  # a node's `ray start` gave up: its log says why
            if len(self.alive_nodes()) >= n:
                return
            time.sleep(0.5)
        self.keep_logs = True  # stop() leaves them where this message says
        tails = "".join(f"\n--- {log} (last lines) ---\n{_tail(self.tmp / log)}" for log in ("head.log", "worker.log")
                        if (self.tmp / log).exists())
        raise RuntimeError(f"Ray cluster of {n} node(s) not up in {timeout:.0f} s ({self.kind}); "
                           f"logs (kept): {self.tmp}/head.log, worker.log{tails}")

    def worker_raylet_pid(self) -> int:
        """The raylet under the worker node's `ray start --block` (our child's child)."""
        kids = psutil.Process(self.worker.pid).children(recursive=True)
        return next(k.pid for k in kids if k.name() == "raylet")

    def kill_worker_raylet(self) -> None:
        """SIGKILL the worker node's raylet. Its process tree is noted first: once the raylet is gone,
        `ray start --block` ends and its other children would no longer be reachable through it."""
        self._noted.update(_tree(self.worker))
        os.kill(self.worker_raylet_pid(), signal.SIGKILL)

    def stop_worker(self) -> None:
        if self.worker is not None:
            _stop_tree(self.worker, self._noted)
            self.procs.remove(self.worker)
            self.worker = None

    def stop(self) -> None:
        self._stop_watcher()
        for p in reversed(self.procs):
            _stop_tree(p, self._noted)
        self.procs.clear()
        self._net_down()
        if not self.keep_logs:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "TwoNodes":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _tree(p: subprocess.Popen) -> dict[int, float]:
    """pid -> create time of p and its descendants (the time tells a reused pid from ours)."""
    try:
        procs = [psutil.Process(p.pid)]
        procs += procs[0].children(recursive=True)
        return {q.pid: q.create_time() for q in procs}
    except psutil.NoSuchProcess:
        return {}


def _stop_tree(p: subprocess.Popen, noted: dict[int, float]) -> None:
    """SIGTERM to `ray start --block` (it stops the node's processes), then SIGKILL to whatever is left of
    its process tree as it is now and as it was noted earlier (kill_worker_raylet), by pid and create time."""
    tree = {**_tree(p)}
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=5)  # a node drains for up to 30 s on SIGTERM: not worth waiting for here
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)
    for pid, created in {**noted, **tree}.items():
        try:
            q = psutil.Process(pid)
            if q.create_time() == created:
                q.kill()
        except psutil.NoSuchProcess:
            pass
