"""The walls around model-written code: Linux namespaces through bubblewrap, and a cgroup per call.

    problem = missing()            # None, or one line naming what this machine lacks (colo.config.checks)
    with Budget(memory_mb=1024, max_procs=32) as budget:
        argv = budget.join(sandbox_argv([python, "-I", "-c", PRELUDE]))   # run argv: the call's whole tree
        ...                                                             # is in the cgroup before any of it runs
        budget.oom_killed(); budget.kill()

Why these, after reading how peers run model code: verl and SkyRL send it to SandboxFusion, a service whose
"lite" isolation is an overlayfs root, a cgroup (cgexec), `unshare --pid --fork --mount-proc`, a network
namespace and chroot, with output capped while it is drained; prime-rl sends it to remote container sandboxes;
OpenAI's codex `linux-sandbox` uses Landlock plus a seccomp filter on network syscalls, and moved to a vendored
bubblewrap for its file system. colo runs the tool beside the engine on a training host, where no service runs,
so the walls are local and the same as SandboxFusion's lite mode, built from two established mechanisms:

- bubblewrap (`bwrap`, Flatpak's sandbox, and codex's): new user, PID, network, IPC, UTS and cgroup
  namespaces, a new session (no TIOCSTI into a terminal), no capabilities, no nested user namespaces, and a
  mount namespace whose root is an empty read-only tmpfs holding only the Python runtime (read-only: the
  interpreter's prefix and the system's /usr and /lib), /proc of its own PID namespace, a minimal /dev, and
  tmpfs /work (its working directory) and /tmp. So: no network (only a loopback that is down), no other
  process in sight (its parent is the namespace's init; the engine's /proc/<pid>/environ is not there), none of
  the user's files (/etc, /home, $HOME, the checkout, the run dir are not mounted), no write outside /work and
  /tmp. bwrap's init is PID 1: when the tool's interpreter exits, or is killed, the kernel kills every process
  left in the namespace (a `setsid()` child included), and --die-with-parent kills it all if the engine dies.
  One C program does the mount set-up that `unshare` would leave to a script of mounts run inside.
- a cgroup per call (v2: memory.max, pids.max; v1, where memory and pids are v1 hierarchies as on this
  project's CI machines: memory.limit_in_bytes (+memsw), pids.max) made inside the engine's own cgroup, so the
  budget is of the whole tree, not per process (rlimits alone let 4 forks hold 4 x the limit), and the
  session's or job's own limits still apply above it. The launcher joins it before exec'ing bwrap, so no
  process of the call runs outside it. A cgroup whose owner died (an engine killed with SIGKILL) is removed by
  the next Budget made on the host.

Per-process rlimits (address space, CPU seconds, file size, open files) stay inside, as a second line: a single
huge allocation then fails with MemoryError instead of an OOM kill.

- a seccomp filter (bwrap --seccomp, seccomp_program) refuses ptrace and process_vm_readv/writev with EPERM: the
  tool's code could attach to the sandbox's init (PID 1 of its namespace, same uid, outside the interpreter's
  rlimits) and stop it, and half of such calls then hung until their timeout. 32-bit and x32 system calls, which
  would take other numbers past the filter, are refused too.
"""
from __future__ import annotations

import itertools
import os
import platform
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

PREFIX = "colo-sandbox-"
WORK = "/work"
TMPFS_BYTES = 64 * 2**20  # each of /work and /tmp; their pages count against the memory budget too
_counter = itertools.count()
_swept: set[str] = set()
_lock = threading.Lock()


def runtime() -> tuple[str, list[str]]:
    """The interpreter the tool runs (this one's base install, not a venv: the standard library only), and the
    bwrap arguments that mount what it needs read-only at the same paths."""
    python = os.path.realpath(sys.executable)
    binds: list[str] = []
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):  # merged /usr: /lib -> usr/lib
            binds += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            binds += ["--ro-bind", top, top]
    prefix = os.path.realpath(sys.base_prefix)
    if not prefix.startswith("/usr/") and prefix != "/usr":  # pyenv, conda, /opt/python: its own tree
        binds += ["--ro-bind", prefix, prefix]
    if not python.startswith(prefix + "/") and not python.startswith("/usr/"):
        binds += ["--ro-bind", python, python]
    return python, binds


# seccomp (linux/seccomp.h, linux/filter.h): the filter sees struct seccomp_data {int nr; u32 arch; ...}
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_ALLOW, _ERRNO, _EPERM = 0x7FFF0000, 0x00050000, 1
_X32 = 0x40000000  # x86-64's x32 ABI: the same calls at other numbers
# machine -> (AUDIT_ARCH of its 64-bit ABI, the numbers of ptrace, process_vm_readv, process_vm_writev)
_ARCHS = {"x86_64": (0xC000003E, (101, 310, 311)), "aarch64": (0xC00000B7, (117, 270, 271))}


def seccomp_program() -> bytes | None:
    """The compiled classic-BPF filter bwrap --seccomp loads (struct sock_filter[]): EPERM for ptrace and the
    process_vm_* calls, and for any system call of another ABI than the machine's 64-bit one; None on a machine
    not in _ARCHS."""
    arch = _ARCHS.get(platform.machine())
    if arch is None:
        return None
    audit, denied = arch
    n = len(denied)
    # 0: arch; 1: other ABI -> deny; 2: nr; 3: x32 -> deny; 4..4+n-1: a denied nr -> deny; then allow, deny
    deny = 4 + n + 1
    prog = [(_LD_W_ABS, 0, 0, 4), (_JEQ_K, 0, deny - 2, audit), (_LD_W_ABS, 0, 0, 0),
            (_JGE_K, deny - 4, 0, _X32)]
    prog += [(_JEQ_K, deny - (5 + i), 0, nr) for i, nr in enumerate(denied)]
    prog += [(_RET_K, 0, 0, _ALLOW), (_RET_K, 0, 0, _ERRNO | _EPERM)]
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


def seccomp_fd() -> int | None:
    """A file descriptor holding seccomp_program(), for one bwrap (it reads it to the end); the caller closes it."""
    prog = seccomp_program()
    if prog is None:
        return None
    fd = os.memfd_create("colo-seccomp", 0)  # not close-on-exec: bwrap inherits it
    os.write(fd, prog)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def sandbox_argv(command: list[str], seccomp: int | None = None) -> list[str]:
    """bwrap around `command` (its argv[0] an absolute path inside the runtime); see the module docstring.
    `seccomp`: a descriptor holding the filter (seccomp_fd), inherited by bwrap."""
    _, binds = runtime()
    env = {"PATH": "/usr/bin:/bin", "HOME": WORK, "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
           "OMP_NUM_THREADS": "1"}
    argv = [bwrap_path() or "bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--cap-drop", "ALL", "--uid", "65534", "--gid", "65534", "--hostname", "sandbox",
            "--clearenv"]
    for k, v in env.items():
        argv += ["--setenv", k, v]
    argv += binds + ["--proc", "/proc", "--dev", "/dev", "--size", str(TMPFS_BYTES), "--tmpfs", WORK,
                     "--size", str(TMPFS_BYTES), "--tmpfs", "/tmp", "--remount-ro", "/", "--chdir", WORK]
    if seccomp is not None:
        argv += ["--seccomp", str(seccomp)]
    return argv + command


def bwrap_path() -> str | None:
    return shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin:" + os.environ.get("PATH", ""))


# ---------------------------------------------------------------------------------------------- cgroups

def _cgroup_dirs() -> dict[str, Path]:
    """Where this process's cgroup is, per usable hierarchy: {"v2": dir} when cgroup v2 holds memory and pids,
    else {"memory": dir, "pids": dir} from the v1 hierarchies; {} when neither."""
    mounts: dict[str, tuple[Path, str]] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, (fstype, _, opts) = left.split(), (right.split() + ["", "", ""])[:3]
        if fstype == "cgroup2":
            mounts.setdefault("v2", (Path(fields[4]), fields[3]))
        elif fstype == "cgroup":
            for ctrl in ("memory", "pids"):
                if ctrl in opts.split(","):
                    mounts.setdefault(ctrl, (Path(fields[4]), fields[3]))
    mine: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        for ctrl in ctrls.split(",") if ctrls else ["v2"]:
            mine[ctrl] = path

    def place(kind: str) -> Path | None:
        if kind not in mounts or kind not in mine:
            return None
        mount, root = mounts[kind]
        path = mine[kind]
        rel = os.path.relpath(path, root) if path.startswith(root) else path.lstrip("/")
        return mount / ("" if rel == "." else rel)

    v2 = place("v2")
    if v2 is not None and {"memory", "pids"} <= set(_read(v2 / "cgroup.controllers").split()):
        return {"v2": v2}
    memory, pids = place("memory"), place("pids")
    return {"memory": memory, "pids": pids} if memory and pids else {}


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


class Budget:
    """One call's cgroup: at most `memory_mb` MiB (swap included where it is accounted) and `max_procs` processes
    for everything the call runs, together. Raises OSError where no cgroup can be made (missing() says why)."""

    def __init__(self, memory_mb: int, max_procs: int) -> None:
        places = _cgroup_dirs()
        if not places:
            raise OSError("no cgroup hierarchy with the memory and pids controllers is mounted")
        name = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.dirs: dict[str, Path] = {}
        limit = str(memory_mb * 2**20)
        try:
            for kind, parent in places.items():
                _sweep(parent)
                if kind == "v2":
                    _delegate(parent)
                d = parent / name
                d.mkdir()
                self.dirs[kind] = d
                if kind == "v2":
                    (d / "memory.max").write_text(limit)
                    if (d / "memory.swap.max").exists():
                        (d / "memory.swap.max").write_text("0")
                    (d / "pids.max").write_text(str(max_procs))
                elif kind == "memory":
                    (d / "memory.limit_in_bytes").write_text(limit)
                    if (d / "memory.memsw.limit_in_bytes").exists():  # memory + swap: no swapping past it
                        (d / "memory.memsw.limit_in_bytes").write_text(limit)
                else:
                    (d / "pids.max").write_text(str(max_procs))
        except OSError:
            self.remove()
            raise

    def join(self, argv: list[str]) -> list[str]:
        """argv run by a shell that first moves itself into this cgroup (every hierarchy), then execs argv: the
        call's first process is in the budget before it runs anything (exit 125 if it cannot join)."""
        files = [str(d / "cgroup.procs") for d in self.dirs.values()]
        script = 'for f; do [ "$f" = -- ] && break; echo $$ > "$f" || exit 125; shift; done; shift; exec "$@"'
        return ["/bin/sh", "-c", script, "sh", *files, "--", *argv]

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the call for the memory budget."""
        if "v2" in self.dirs:
            text = _read(self.dirs["v2"] / "memory.events")
        else:
            text = _read(self.dirs["memory"] / "memory.oom_control")
        fields = dict(line.split()[:2] for line in text.splitlines() if len(line.split()) >= 2)
        return int(fields.get("oom_kill", "0")) > 0

    def pids(self) -> list[int]:
        d = self.dirs.get("v2") or self.dirs.get("pids")
        return [int(p) for p in _read(d / "cgroup.procs").split()] if d else []

    def kill(self, wait_s: float = 5.0) -> None:
        """SIGKILL every process in the cgroup until none is left (the PID namespace usually got there first)."""
        deadline = time.monotonic() + wait_s
        while True:
            pids = self.pids()
            if not pids or time.monotonic() > deadline:
                return
            if "v2" in self.dirs and (self.dirs["v2"] / "cgroup.kill").exists():
                (self.dirs["v2"] / "cgroup.kill").write_text("1")
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)

    def remove(self) -> None:
        for d in self.dirs.values():
            _rmdir(d)
        self.dirs = {}

    def __enter__(self) -> Budget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
        self.remove()


def _rmdir(d: Path, tries: int = 50) -> None:
    for _ in range(tries):  # a cgroup is removable once its last process is reaped, a moment after SIGKILL
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)


def _delegate(parent: Path) -> None:
    """cgroup v2 distributes memory and pids to children only when the parent's subtree_control lists them."""
    wanted = {"memory", "pids"} - set(_read(parent / "cgroup.subtree_control").split())
    if wanted:
        (parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(wanted)))


def _sweep(parent: Path) -> None:
    """Once per hierarchy and process: remove the cgroups of owners that are gone (killed engines)."""
    with _lock:
        if str(parent) in _swept:
            return
        _swept.add(str(parent))
    for d in parent.glob(f"{PREFIX}*-*"):
        owner = d.name[len(PREFIX):].partition("-")[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            for pid in _read(d / "cgroup.procs").split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _rmdir(d, tries=10)


# ------------------------------------------------------------------------------------------ what is missing

_MISSING: list[str | None] = []


def missing() -> str | None:
    """None when tool code can be isolated here, else one line naming what is missing and the fix (probed once
    per process: a cgroup made and removed, and a real sandboxed interpreter run)."""
    if not _MISSING:
        _MISSING.append(_probe())
    return _MISSING[0]


def _probe() -> str | None:
    fix = ("fix: bash launch/setup.sh as root installs it (Debian/Ubuntu package bubblewrap), or "
           "algo.unsafe_unsandboxed_tools=true to run tool code without isolation")
    if sys.platform != "linux":
        return f"the Python tool's sandbox needs Linux namespaces and cgroups, not {sys.platform}; {fix}"
    if not bwrap_path():
        return f"the Python tool's sandbox needs bubblewrap (bwrap), which is not installed; {fix}"
    try:
        budget = Budget(64, 8)
    except OSError as e:
        return (f"the Python tool's sandbox needs a cgroup of its own for the call's memory and process budget, and "
                f"none can be made here ({e}); fix: run colo where it may create cgroups (root, or a cgroup v2 "
                "subtree delegated to it, e.g. systemd-run --user --scope -p Delegate=yes), or "
                "algo.unsafe_unsandboxed_tools=true to run tool code without isolation")
    filt = None
    try:
        python, _ = runtime()
        filt = seccomp_fd()
        r = subprocess.run(budget.join(sandbox_argv([python, "-I", "-S", "-c", "print('ok')"], filt)), env={},
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
                           pass_fds=() if filt is None else (filt,))
    except (OSError, subprocess.TimeoutExpired) as e:
        r = subprocess.CompletedProcess([], 1, "", str(e))
    finally:
        if filt is not None:
            os.close(filt)
        budget.kill()
        budget.remove()
    if r.returncode != 0 or r.stdout.strip() != "ok":
        why = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        return (f"the Python tool's sandbox cannot start here: bwrap failed ({why}); fix: allow user namespaces "
                "(sysctl kernel.unprivileged_userns_clone=1, or user.max_user_namespaces > 0), or "
                "algo.unsafe_unsandboxed_tools=true to run tool code without isolation")
    return None
