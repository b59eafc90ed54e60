"""Whether this host can start the run, checked before Ray: what Ray, vLLM and the weight sync need of it and
reported only after Ray had started, as their own traceback or a death without a cause.

    check_host(cfg)     # ConfigError (one line, the fix) or the host is fit; colo.launch calls it before the run dir
                        # with the config as given (an auto: model is not generated yet)

- $HOME writable: Ray keeps its session token in $HOME/.ray (a read-only $HOME gave Ray's OSError traceback).
- Ray's temporary folder (RAY_TMPDIR, else TMPDIR, else /tmp) writable and short enough: Ray's unix sockets live
  under <it>/ray/session_<date>_<time>_<us>_<pid>/sockets/, and a socket path holds at most 107 bytes (a TMPDIR
  longer than ~40 characters gave Ray's "AF_UNIX path length" traceback).
- /dev/shm large enough for the colocated CPU sync's buffers (colo.sync.transport: each trainer rank maps
  sync.buffers of up to sync.bucket_mb MiB there): a Docker-sized 64 MiB /dev/shm killed the trainers with SIGBUS,
  reported as "trainer rank 0 died".
A run that joins a Ray cluster (run.ray_address) uses the cluster's folders: only /dev/shm is checked then.
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from colo.config import ColoConfig, ConfigError, model_config_json
from colo.config.loading import ray_temp_root, resolve_device
from colo.plan.disk import size
from colo.plan.memory import model_shape

SOCKET_MAX = 107  # bytes of a unix socket path (sun_path, less its NUL)
SOCKET = "sockets/plasma_store"  # the longest name Ray puts in a session's sockets folder
SHM = Path("/dev/shm")


def check_host(cfg: ColoConfig, home: Path | None = None, ray_tmp: Path | None = None, shm: Path = SHM) -> None:
    """Raises ConfigError for the first thing this host lacks (module docstring). `home`, `ray_tmp`: as Ray will
    see them (default: this process's $HOME and ray_temp_root())."""
    if not cfg.run.ray_address:
        home = Path.home() if home is None else home
        ray_tmp = ray_temp_root() if ray_tmp is None else ray_tmp
        _writable(home / ".ray", "$HOME", home, "Ray keeps its session token in $HOME/.ray",
                  "point HOME at a writable folder (e.g. HOME=/tmp/colo-home)")
        _writable(ray_tmp, "the temporary folder", ray_tmp, "Ray keeps its session there",
                  "set TMPDIR (or RAY_TMPDIR) to a writable folder with a short path, e.g. TMPDIR=/tmp")
        socket = ray_tmp / "ray" / f"session_2026-01-01_00-00-00_000000_{'9' * _pid_digits()}" / SOCKET
        if len(os.fsencode(socket)) > SOCKET_MAX:
            room = SOCKET_MAX - (len(os.fsencode(socket)) - len(os.fsencode(ray_tmp)))
            raise ConfigError(f"the temporary folder {ray_tmp} is too long a path for Ray ({len(str(ray_tmp))} "
                              f"characters; its sockets under <it>/ray/session_.../sockets/ need it at most {room}: a "
                              f"socket path holds {SOCKET_MAX} bytes); fix: set TMPDIR (or RAY_TMPDIR) to a short "
                              "folder, e.g. TMPDIR=/tmp")
    need, why = shm_need(cfg)
    if need:
        try:
            free = shutil.disk_usage(shm).free
        except OSError:
            return  # no /dev/shm to read (not Linux): the transport says so itself
        if free < need:
            raise ConfigError(f"{shm} has {size(free)} free, and {why} needs {size(need)}; fix: a larger {shm} "
                              f"(docker run --shm-size={max(1, -(-need // 2**30) * 2)}g; Kubernetes: an emptyDir "
                              "with medium: Memory), or smaller buffers (sync.bucket_mb, sync.buffers)")


def shm_need(cfg: ColoConfig) -> tuple[int, str]:
    """(bytes, what) the run maps in /dev/shm on this host: the colocated CPU sync's buffers, at most a bucket each
    and at most the model's weights each (a small model does not fill a 1 GiB bucket). (0, "") when it maps none
    there (CUDA IPC on GPU; disaggregated buffers are private). `cfg` as given (model.path an auto: preset, or a
    path that exists; placement.device may be auto)."""
    if cfg.placement.mode != "colocated" or resolve_device(cfg) != "cpu":
        return 0, ""
    try:
        weights = model_shape(model_config_json(cfg)).numel * (4 if cfg.model.dtype == "float32" else 2)
    except (KeyError, TypeError, ValueError):  # a config.json transformers cannot read: the run dir's check names it
        return 0, ""
    per = min(int(float(cfg.sync.bucket_mb) * 2**20), weights) * max(1, int(cfg.sync.buffers))
    ranks = int(cfg.placement.num_gpus)
    return per * ranks, (f"the weight sync ({ranks} trainer rank{'s' * (ranks != 1)} x {cfg.sync.buffers} buffers "
                         f"of {size(per // max(1, int(cfg.sync.buffers)))})")


def _writable(probe_dir: Path, what: str, where: Path, why: str, fix: str) -> None:
    try:
        probe_dir.mkdir(parents=True, exist_ok=True)
        probe = probe_dir / f".colo-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        reason = e.strerror or str(e)
        if e.errno == errno.ENOSPC:
            fix = "free space there, or " + fix
        raise ConfigError(f"{what} {where} is not writable ({reason}); {why}; fix: {fix}") from e


def _pid_digits() -> int:
    try:
        return len(Path("/proc/sys/kernel/pid_max").read_text().strip())
    except OSError:
        return 7
