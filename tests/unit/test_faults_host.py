"""The host checked before Ray (colo.plan.preflight): a read-only $HOME, a temporary folder too long for Ray's sockets
or not writable, a /dev/shm too small for the sync's buffers. Each was found after Ray had started: Ray's OSError
or socket-path traceback, or trainers dying of SIGBUS reported as "trainer rank 0 died". Now one line, before
anything is written or started. A small tmpfs stands in for each place (root only: skipped elsewhere)."""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import clean_env, run_cli, tmpfs

from colo.config import ConfigError, load_config
from colo.plan.preflight import check_host, shm_need


SHORT = Path(tempfile.gettempdir())  # the session's temporary folder: short (tests/conftest.py)


def cfg(*overrides: str):
    return load_config(None, ["placement.device=cpu", "placement.num_gpus=2", *overrides], {})


def refusal(**kw) -> str:
    with pytest.raises(ConfigError) as e:
        check_host(**kw)
    msg = str(e.value)
    assert "\n" not in msg and "fix:" in msg, msg
    return msg


def test_home_and_tmpdir_must_be_writable(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        msg = refusal(cfg=cfg(), home=ro, ray_tmp=tmp_path)
        assert msg.startswith(f"$HOME {ro} is not writable (Read-only file system); Ray keeps its session token in "
                              "$HOME/.ray; fix: point HOME at a writable folder"), msg
        msg = refusal(cfg=cfg(), home=tmp_path, ray_tmp=ro)
        assert msg.startswith(f"the temporary folder {ro} is not writable (Read-only file system)"), msg
    check_host(cfg(), home=tmp_path, ray_tmp=SHORT)  # both writable: fit
    assert (tmp_path / ".ray").is_dir() and not list((tmp_path / ".ray").iterdir())  # the probe is gone


def test_a_tmpdir_too_long_for_rays_sockets(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    msg = refusal(cfg=cfg(), home=tmp_path, ray_tmp=deep)
    assert msg.startswith(f"the temporary folder {deep} is too long a path for Ray ({len(str(deep))} characters; ") \
        and "fix: set TMPDIR (or RAY_TMPDIR) to a short folder, e.g. TMPDIR=/tmp" in msg, msg
    check_host(cfg("run.ray_address=10.0.0.1:6379"), home=tmp_path, ray_tmp=deep)  # a joined cluster's own folders


def test_dev_shm_too_small_for_the_sync_buffers(tmp_path: Path) -> None:
    """The tiny model's two trainer ranks map 2 x 2 buffers of its weights (1.4 MiB in bfloat16, less than a bucket)
    in /dev/shm; a 4 MiB /dev/shm holds them, a 2 MiB one does not."""
    need, why = shm_need(cfg())
    assert 4 << 20 < need < 8 << 20 and why.startswith("the weight sync (2 trainer ranks x 2 buffers of "), (need, why)
    assert shm_need(cfg("placement.device=cuda")) == (0, "") and shm_need(cfg("placement.mode=disaggregated",
                                                                              "placement.trainer_gpus=1"))[0] == 0
    with tmpfs(tmp_path / "shm", "size=2m") as shm:
        msg = refusal(cfg=cfg(), home=tmp_path, ray_tmp=SHORT, shm=shm)
        assert msg.startswith(f"{shm} has 2.0 MiB free, and the weight sync (2 trainer ranks x 2 buffers of ") and \
            "fix: a larger" in msg and "--shm-size=" in msg, msg
    with tmpfs(tmp_path / "shm2", "size=16m") as shm:
        check_host(cfg(), home=tmp_path, ray_tmp=SHORT, shm=shm)


def test_the_cli_refuses_a_long_tmpdir_before_ray(tmp_path: Path) -> None:
    deep = tmp_path / ("t" * 70)
    deep.mkdir()
    run_dir = tmp_path / "run"
    r = run_cli(f"run.dir={run_dir}", "placement.num_gpus=1", env=clean_env(TMPDIR=str(deep)), timeout=120,
                imports=True)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"colo: error: the temporary folder {deep} "
                                                                          "is too long a path for Ray"), r.stderr
    assert not run_dir.exists() and "ray" not in r.imported


DIES = """import os, signal, sys, time
from pathlib import Path
from colo.run.logs import record_fatal
record_fatal(Path(sys.argv[1]))  # as colo.run.logs.actor_output does in each actor
os.kill(os.getpid(), getattr(signal, sys.argv[2]))
time.sleep(60)
"""


def test_an_actor_that_dies_of_a_signal_says_which(tmp_path: Path) -> None:
    """A trainer killed by SIGBUS (a full /dev/shm) was reported as "trainer rank 0 died" and nothing else: the crash
    log its process keeps says which signal, and what it usually means; a SIGKILL leaves none, which is said too."""
    import sys

    from colo.run.logs import crash_log, died_of

    log = tmp_path / "logs" / "trainer-0.log"
    for sig, clause in (("SIGBUS", " of SIGBUS (memory it had mapped went away: usually /dev/shm full"),
                        ("SIGSEGV", " of SIGSEGV (a crash in native code"),
                        ("SIGKILL", " without a fatal signal recorded (a SIGKILL leaves none: usually the kernel's OOM "
                                    "killer")):
        p = subprocess.run([sys.executable, "-c", DIES, str(crash_log(log)), sig], env=clean_env(), timeout=120,
                           capture_output=True)
        assert p.returncode == -getattr(__import__("signal"), sig), p
        assert died_of(log).startswith(clause), (sig, died_of(log))
    assert died_of(None) == ""
