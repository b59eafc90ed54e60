"""The Python tool's sandbox (colo.envs.sandbox, colo.envs.isolation) against what model-written code tried (issue
49): each escape separately, through run_python as PythonEnv calls it, on the real bubblewrap and cgroups of this
machine. Then the happy path, the refusal where the sandbox is missing, and environment code kept out of the
driver (colo.envs.offdriver). No Ray, no vLLM. The tests marked `sandbox` need it: where it is missing they skip
with what is missing and how to install it, or fail under TESTS_REQUIRE_SANDBOX=1 (.ci/run; tests/conftest.py)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colo.envs import isolation
from colo.envs.base import Turn
from colo.envs.sandbox import MAX_OUTPUT, MAX_PROCS, PythonEnv, SandboxUnavailable, permit_unsandboxed, run_python

ROOT = Path(__file__).resolve().parents[2]


def in_a_caller(code: str, env: dict | None = None, **kw) -> dict:
    """run_python(code) from a process of its own (an engine's stand-in, with `env` added to its environment): what
    it returned, and whether the caller lived through it. `code` may name the caller's pid as CALLER."""
    probe = (f"import json, os, resource, sys, time; from colo.envs.sandbox import run_python\n"
             f"t = time.monotonic(); r = run_python({code!r}.replace('CALLER', str(os.getpid())), **{kw!r})\n"
             "print(json.dumps({'stdout': r.stdout, 'error': r.error, 'seconds': time.monotonic() - t,\n"
             "                  'maxrss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    assert p.returncode == 0, f"the caller died: exit {p.returncode}; {p.stderr[-2000:]}"
    return json.loads(p.stdout.splitlines()[-1])


@pytest.mark.sandbox
def test_it_cannot_kill_its_parent() -> None:
    """os.kill(os.getppid(), 9) killed the engine: inside, the parent is the namespace's init, and the caller's
    pid names nothing (or another process of the namespace)."""
    r = in_a_caller("import os\nfor pid in (os.getppid(), CALLER):\n"
                    "    try:\n        os.kill(pid, 9)\n        print(pid, 'sent')\n"
                    "    except OSError as e:\n        print(pid, type(e).__name__)\nprint('after')")
    assert r["error"] is None and r["stdout"].splitlines()[-1] == "after", r
    assert "ProcessLookupError" in r["stdout"], r  # the caller's pid does not exist in its PID namespace


@pytest.mark.sandbox
def test_it_cannot_read_the_callers_environment() -> None:
    """/proc/<parent>/environ held WANDB_API_KEY (Ray passes the driver's environment to actors)."""
    code = ("import glob\nfor f in ['/proc/CALLER/environ', '/proc/1/environ', *glob.glob('/proc/*/environ')]:\n"
            "    try:\n        print(f, open(f, 'rb').read())\n"
            "    except OSError as e:\n        print(f, type(e).__name__)")
    r = in_a_caller(code, env={"WANDB_API_KEY": "sekrit-4711"}, timeout_s=20)
    assert r["error"] is None and "/environ FileNotFoundError" in r["stdout"].splitlines()[0], r
    assert "sekrit-4711" not in r["stdout"] and "WANDB" not in r["stdout"], r


@pytest.mark.sandbox
def test_it_cannot_read_the_users_files(tmp_path: Path) -> None:
    """/etc/passwd, $HOME (~/.netrc: W&B and Hub credentials), and any file of the user's."""
    (tmp_path / "netrc").write_text("machine api.wandb.ai password sekrit")
    code = (f"import os\nfor f in ['/etc/passwd', {str(tmp_path / 'netrc')!r}, {os.path.expanduser('~/.netrc')!r}]:\n"
            "    try:\n        print(f, open(f).read())\n    except OSError as e:\n        print(f, type(e).__name__)\n"
            f"for d in [{os.path.expanduser('~')!r}, {str(ROOT)!r}, '/etc']:\n"
            "    try:\n        print(d, os.listdir(d))\n    except OSError as e:\n        print(d, type(e).__name__)")
    r = run_python(code, timeout_s=20)
    assert r.error is None, r
    assert "sekrit" not in r.stdout and "root:" not in r.stdout, r
    lines = r.stdout.splitlines()
    assert all(line.endswith("FileNotFoundError") for line in lines[:3] + lines[4:]), r
    home, runtime = Path(os.path.expanduser("~")), Path(os.path.realpath(sys.base_prefix))
    # $HOME holds nothing but the way to the Python runtime, where that is under it (pyenv: ~/.pyenv/versions/..)
    seen = [] if lines[3].endswith("FileNotFoundError") else eval(lines[3].split(" ", 1)[1])  # noqa: S307
    assert seen == ([runtime.relative_to(home).parts[0]] if runtime.is_relative_to(home) else []), r


@pytest.mark.sandbox
def test_it_cannot_write_outside_its_work_dir(tmp_path: Path) -> None:
    target = tmp_path / "escaped.txt"
    code = (f"for f in [{str(target)!r}, '/usr/escaped', '/escaped', '/work/mine.txt', '/tmp/mine.txt']:\n"
            "    try:\n        open(f, 'w').write('x'); print(f, 'written')\n"
            "    except OSError as e:\n        print(f, type(e).__name__)")
    r = run_python(code, timeout_s=20)
    assert r.error is None and not target.exists() and not Path("/usr/escaped").exists(), r
    assert "/work/mine.txt written" in r.stdout and "/tmp/mine.txt written" in r.stdout, r
    assert "written" not in r.stdout.split("/work/")[0], r  # the first three failed


@pytest.mark.sandbox
def test_it_has_no_network() -> None:
    """TCP to 127.0.0.1, where Ray's GCS and dashboard listen: refused, and the listener sees nothing."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        r = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 3)", timeout_s=20)
        assert r.error and ("ConnectionRefusedError" in r.error or "OSError" in r.error), r
        with pytest.raises(TimeoutError):
            server.accept()


def _alive_with(token: str) -> list[int]:
    out = []
    for p in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            if token.encode() in Path(f"/proc/{p}/cmdline").read_bytes():
                out.append(int(p))
        except OSError:
            pass
    return out


@pytest.mark.sandbox
def test_a_setsid_child_does_not_outlive_the_call() -> None:
    """fork, setsid() and return: the call ended in 0.05 s and its children lived on."""
    token = f"colo-escape-{os.getpid()}-{time.monotonic_ns()}"
    code = ("import os, sys\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {token!r}])\n"
            "    os._exit(0)\nimport time; time.sleep(0.5); print('returned')")
    r = run_python(code, timeout_s=20)
    assert r.error is None and r.stdout == "returned\n", r
    assert _alive_with(token) == []
    code = code.replace("time.sleep(0.5); print('returned')", "time.sleep(60)")  # and at the deadline
    t0 = time.monotonic()
    r = run_python(code, timeout_s=2)
    assert r.error == "timed out after 2 s" and time.monotonic() - t0 < 10, r
    assert _alive_with(token) == []


FOUR_CHILDREN = ("import os, time\nkids = []\nfor i in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
                 "        x = b'x' * (150 * 2**20)\n        print('held', i, flush=True)\n        time.sleep(3)\n"
                 "        os._exit(0)\n    kids.append(pid)\nprint([os.waitpid(k, 0)[1] for k in kids])")


@pytest.mark.sandbox
def test_memory_is_a_budget_of_the_whole_tree() -> None:
    """The limit was per process: 4 forked children held 4 x it. Here 4 children of 150 MiB each in a 256 MiB
    budget: the kernel kills what does not fit, and the call says so."""
    r = run_python(FOUR_CHILDREN, timeout_s=30, memory_mb=256)
    assert r.error == "memory limit: its processes together needed more than 256 MiB", r
    # never two at once: at most one child lived to its end; the kernel kills a child that already held its 150 MiB
    # (and had said so) as readily as the one asking for more, so "held" may show twice (seen under load)
    statuses = [int(x) for x in r.stdout.strip().splitlines()[-1].strip("[]").split(",")]
    assert len(statuses) == 4 and statuses.count(0) <= 1, r


@pytest.mark.sandbox
def test_forks_are_bounded() -> None:
    """200 forks all succeeded; here the call's processes stop at MAX_PROCS, and all of them end with it."""
    token = f"colo-bomb-{os.getpid()}-{time.monotonic_ns()}"
    code = ("import os, sys, time\nn = 0\nfor i in range(200):\n    try:\n        if os.fork() == 0:\n"
            f"            os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {token!r}])\n"
            "        n += 1\n    except OSError as e:\n        print(type(e).__name__); break\nprint(n)")
    r = run_python(code, timeout_s=30)
    assert r.error is None and r.stdout.splitlines()[0] == "BlockingIOError", r
    assert int(r.stdout.splitlines()[-1]) < MAX_PROCS, r
    assert _alive_with(token) == []


@pytest.mark.sandbox
def test_it_cannot_ptrace_the_sandboxs_init() -> None:
    """PTRACE_ATTACH to PID 1 (bwrap's init: same uid, outside the interpreter's rlimits) succeeded and stopped it;
    half of such calls then hung until their timeout. ptrace and process_vm_* are refused now (seccomp), and the
    call ends at once."""
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.ptrace(16, 1, 0, 0), os.strerror(ctypes.get_errno()))\n"  # PTRACE_ATTACH
            "buf = ctypes.create_string_buffer(8)\n"
            "class iov(ctypes.Structure):\n    _fields_ = [('base', ctypes.c_void_p), ('len', ctypes.c_size_t)]\n"
            "v = iov(ctypes.cast(buf, ctypes.c_void_p), 8)\n"
            "print(libc.process_vm_readv(1, ctypes.byref(v), 1, ctypes.byref(v), 1, 0), "
            "os.strerror(ctypes.get_errno()))")
    t0 = time.monotonic()
    r = run_python(code, timeout_s=20)
    assert r.error is None and r.stdout == "-1 Operation not permitted\n-1 Operation not permitted\n", r
    assert time.monotonic() - t0 < 15


@pytest.mark.sandbox
def test_output_is_bounded_while_it_is_read() -> None:
    """400 MB of output took the caller to 1.16 GiB: the bound applied after it had buffered all of it. Here a
    300 MB flood stops at the bound, and the caller's memory stays where a small call leaves it."""
    flood = in_a_caller("import sys\nfor _ in range(300):\n    sys.stdout.write('x' * 2**20)")
    small = in_a_caller("print('x')")
    assert flood["error"] == f"output limit: more than {MAX_OUTPUT} characters; the program was stopped", flood
    assert flood["stdout"] == "x" * MAX_OUTPUT and flood["seconds"] < 15, flood
    assert flood["maxrss_mb"] < small["maxrss_mb"] + 30, (flood, small)


@pytest.mark.sandbox
def test_the_python_tool_still_works() -> None:
    """The happy path: output, a notebook's last expression, errors as the model needs them."""
    assert run_python("print(2**10)").stdout == "1024\n"
    assert run_python("x = 47*12\nx + 35").stdout == "599\n"
    assert run_python("import math, fractions, json, decimal\nmath.comb(10, 3)").stdout == "120\n"
    r = run_python("print('before'); raise ValueError('boom')")
    assert (r.stdout, r.error) == ("before\n", "ValueError: boom")
    assert run_python("x = bytearray(4 * 1024**3)", memory_mb=256).error == "MemoryError"
    assert run_python("while True: pass", timeout_s=1.5).error == "timed out after 1.5 s"
    env = PythonEnv()
    step = env.step(turn('<tool_call>{"name": "python", "arguments": {"code": "print(2**20)"}}</tool_call>'))
    assert (step.observation, step.tool_calls, step.tool_errors) == ("1048576\n", 1, 0)
    solved = env.solution({"prompt": "Calculate 47*12+35.", "answer": "599"})
    assert solved == ["<tool_call>47*12+35</tool_call>", "599"]
    assert env.solution({"prompt": "How many eggs are there in 12 boxes?", "answer": "144"}) is None


def turn(text: str) -> Turn:
    return Turn(text, (), 0, "stop")


def test_without_the_sandbox_the_tool_is_refused_unless_the_user_says_unsafe(monkeypatch: pytest.MonkeyPatch) -> None:
    """No bwrap: algo.environment=python is refused at launch with one line naming it, and run_python refuses;
    algo.unsafe_unsandboxed_tools=true runs the code as a plain subprocess."""
    from colo.config import ConfigError, load_config
    from colo.config.checks import _check_environment

    monkeypatch.setattr(isolation, "bwrap_path", lambda: None)
    monkeypatch.setattr(isolation, "_MISSING", [])
    with pytest.raises(ConfigError) as e:
        _check_environment(load_config(None, ["algo.environment=python"], {}))
    assert "needs bubblewrap (bwrap), which is not installed" in str(e.value) and "\n" not in str(e.value)
    assert "algo.unsafe_unsandboxed_tools=true" in str(e.value) and "launch/setup.sh" in str(e.value)
    _check_environment(load_config(None, ["algo.environment=python", "algo.unsafe_unsandboxed_tools=true"], {}))
    _check_environment(load_config(None, ["algo.environment=calculator"], {}))  # runs no code
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        run_python("print(1)")
    permit_unsandboxed(True)
    try:
        r = run_python("import os; print(os.path.exists('/etc/passwd'))")
        assert (r.stdout, r.error) == ("True\n", None)  # unsafe indeed
        # the rlimits are per process: 4 forked children of 150 MiB held 600 MiB of a 256 MiB budget; the tree's
        # memory is watched as a whole there too
        r = run_python(FOUR_CHILDREN, timeout_s=30, memory_mb=256)
        assert r.error == "memory limit: its processes together needed more than 256 MiB", r
    finally:
        permit_unsandboxed(False)


@pytest.mark.sandbox
def test_no_cgroup_of_a_dead_caller_is_left(tmp_path: Path) -> None:
    """A caller killed mid-call (an engine's SIGKILL) leaves its sandbox's cgroup behind; the next call sweeps it."""
    probe = ("import sys; sys.path.insert(0, %r)\nfrom colo.envs.sandbox import run_python\n"
             "run_python('import time; print(1, flush=True); time.sleep(60)', timeout_s=60)" % str(ROOT))
    p = subprocess.Popen([sys.executable, "-c", probe])
    try:
        deadline = time.monotonic() + 60
        while not _cgroups_of(p.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _cgroups_of(p.pid)
    finally:
        p.kill()
        p.wait()
    isolation._swept.clear()  # this process swept already: as a fresh engine would
    run_python("print(1)")
    assert _cgroups_of(p.pid) == []


def _cgroups_of(pid: int) -> list[str]:
    return [str(d) for parent in isolation._cgroup_dirs().values() for d in parent.glob(f"{isolation.PREFIX}{pid}-*")]


class Killer:
    """A user environment whose demonstration step kills its process (the warm-up's tool call did that to the
    driver: exit -9, no message)."""

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, turn):
        os.kill(os.getpid(), 9)

    def solution(self, row):
        return ["<tool_call>boom</tool_call>", "1"]


def test_the_driver_runs_no_environment_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """RunInputs builds the warm-up's demonstrations in the environment's own process: one that kills itself
    ends there, named in an EnvError, and the driver goes on; the calculator's demonstrations are as before."""
    from colo.data.inputs import RunInputs
    from colo.envs.base import EnvError
    from colo.models.tiny import TOKENIZER_VOCAB
    from colo.models.tokenizer import build_tokenizer

    (tmp_path / "killer_env.py").write_text("import os\n" + _source(Killer))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{ROOT}")  # the worker is spawned: a fresh interpreter
    tok = build_tokenizer(TOKENIZER_VOCAB, tools=True)
    pairs = [("Calculate 47*12+35.", "599"), ("Calculate 10*10+1.", "101")]
    inputs = RunInputs(tmp_path, tok, None, [], pairs, chat_template=True, environment="killer_env:Killer")
    with pytest.raises(EnvError, match="its process died while building the warm-up's demonstrations"):
        inputs.sft_batch(2, 0)
    calc = RunInputs(tmp_path, tok, None, [], pairs, chat_template=True, environment="calculator")
    batch = calc.sft_batch(4, 0)
    text = tok.decode(batch["input_ids"][0][batch["attention_mask"][0].bool()])
    assert "<tool_call>" in text and ("599" in text or "101" in text), text
    assert calc._worker is not None and len(calc._demos) == 2  # each row built once, in the worker


def _source(cls: type) -> str:
    import inspect

    return inspect.getsource(cls)
