"""Model-written Python, run where it can do no harm: a sandboxed subprocess, never the driver or an engine.

    r = run_python("print(2**10)", timeout_s=5, memory_mb=512)   # Ran(stdout="1024\n", error=None, ...)

Each call runs a fresh interpreter (isolated mode, the runtime's standard library) inside bubblewrap's
namespaces and a cgroup of its own (colo.envs.isolation, which says why these): no network, no other
process in sight, none of the user's files, writes only to its tmpfs /work and /tmp, and at most `memory_mb`
MiB and MAX_PROCS processes for the whole tree. Per-process rlimits (address space, CPU seconds, file size,
open files) apply inside as well. Output is read as it comes and bounded while it is read: past
MAX_OUTPUT characters (4 bytes each at most) the call is stopped, so a flood never reaches the caller's
memory. At `timeout_s` every process of the call is killed (the PID namespace ends with its interpreter, a
`setsid()` child included). The code comes on stdin; as in a notebook, the value of a last bare expression is
printed (`47*12+35` answers 599).

Where the sandbox cannot run (isolation.missing() says why: no bwrap, no cgroup, no user namespaces) a call
raises SandboxUnavailable, unless the process allowed unsandboxed runs (permit_unsandboxed, from
algo.unsafe_unsandboxed_tools): then the code runs as a plain subprocess under the rlimits, in its own session
and a temporary folder, which contains mistakes but not a hostile program. Its memory is watched as a whole there
too (the resident memory of its process tree, read every WATCH_S): the rlimits alone are per process, and 4 forked
children held 4 x the limit at once.

The "python" environment (PythonEnv) runs the code of every <tool_call> and answers with its output:

    <tool_call>print(sum(range(10)))</tool_call>     or   <tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>
"""
from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from colo.envs.base import Environment, Step, Turn
from colo.envs.calculator import CALL, EXPRESSION
from colo.envs.isolation import Budget, missing, runtime, sandbox_argv, seccomp_fd

MAX_OUTPUT = 2000  # characters of stdout kept; the call is stopped once more than 4x as many bytes came
MAX_PROCS = 32  # processes of one call, its interpreter included
ERR_TAIL = 8192  # bytes of stderr kept (its end: a traceback's last line)
WATCH_S = 0.05  # unsandboxed: how often the tree's resident memory is read


@dataclass
class Ran:
    stdout: str
    error: str | None  # None: exit 0; else the last line of stderr, "timed out after ..", a budget, or the signal
    returncode: int | None


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run on this machine and unsandboxed runs were not allowed."""


_PERMIT = [False]


def permit_unsandboxed(on: bool) -> None:
    """algo.unsafe_unsandboxed_tools for this process (an engine sets it from its config): where the sandbox is
    missing, run tool code without it instead of refusing."""
    _PERMIT[0] = bool(on)


# The child sets its limits, then reads the code from stdin (any size; no argv limit): a preexec_fn would run
# between fork and exec in a process with threads (an engine's), which Python documents as unsafe.
PRELUDE = """import ast, resource, sys
mem, cpu = int(sys.argv[1]) * 2**20, int(sys.argv[2])
for what, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, 16 * 2**20),
                    (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(what, (value, value))
code = sys.stdin.buffer.read().decode("utf-8", "replace")
del resource, mem, cpu, what, value
sys.argv = ["tool"]
tree = ast.parse(code, "<tool>")
last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
scope = {"__name__": "__main__"}
exec(compile(tree, "<tool>", "exec"), scope)
if last is not None:
    value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), scope)
    if value is not None:
        print(repr(value))
"""


def run_python(code: str, timeout_s: float = 10.0, memory_mb: int = 1024, max_procs: int = MAX_PROCS) -> Ran:
    """Run `code` in the sandbox (module docstring); wall-clock `timeout_s` for everything it starts."""
    problem = missing()
    if problem and not _PERMIT[0]:
        raise SandboxUnavailable(problem)
    python, _ = runtime()
    cmd = [python, "-I", "-c", PRELUDE, str(memory_mb), str(max(1, int(timeout_s) + 1))]
    budget = Budget(memory_mb, max_procs) if problem is None else None
    tmp = None if budget else tempfile.mkdtemp(prefix="colo-tool-")
    filt = seccomp_fd() if budget else None  # no ptrace of the sandbox's init (colo.envs.isolation)
    argv = budget.join(sandbox_argv(cmd, filt)) if budget else cmd
    oom = False
    try:
        try:
            proc = subprocess.Popen(argv, cwd=tmp or "/", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, pass_fds=() if filt is None else
                                    (filt,), env={"PATH": "/usr/bin:/bin", "HOME": tmp or "/", "PYTHONHASHSEED": "0",
                                                  "OMP_NUM_THREADS": "1"})
        finally:
            if filt is not None:
                os.close(filt)
        try:
            watch = None if budget else (lambda: _tree_rss(proc.pid) > memory_mb * 2**20)
            out, err, why = _communicate(proc, code.encode("utf-8", "replace"), time.monotonic() + timeout_s, watch)
        finally:
            if proc.poll() is None:
                _kill(proc, budget)
            proc.wait()
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe and not pipe.closed:
                    pipe.close()
    finally:
        if budget is not None:
            oom = budget.oom_killed()
            budget.kill()
            budget.remove()
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    text = out.decode("utf-8", "replace")[:MAX_OUTPUT]
    if oom or why == "memory":  # first: a kill for memory is why a call that then ran out of time got stuck
        return Ran(text, f"memory limit: its processes together needed more than {memory_mb} MiB", proc.returncode)
    if why == "timeout":
        return Ran(text, f"timed out after {timeout_s:g} s", None)
    if why == "output":
        return Ran(text, f"output limit: more than {MAX_OUTPUT} characters; the program was stopped", None)
    rc = proc.returncode
    if rc == 0:
        return Ran(text, None, 0)
    if rc == 125 and budget is not None and not err:
        return Ran(text, "sandbox set-up failed: could not join its cgroup", rc)
    sig = -rc if rc < 0 else rc - 128 if budget is not None and 128 < rc < 128 + 65 and not err.strip() else 0
    if sig:
        why_sig = f"killed by {_signal_name(sig)}" + (" (CPU time limit)" if sig == signal.SIGXCPU else "")
        return Ran(text, why_sig, rc)
    last = (err.decode("utf-8", "replace").strip().splitlines() or [f"exit status {rc}"])[-1]
    return Ran(text, last[:MAX_OUTPUT], rc)


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _kill(proc: subprocess.Popen, budget: Budget | None) -> None:
    """The call's whole tree: bwrap (its sandbox's init dies with it, and the kernel ends the PID namespace),
    then whatever the cgroup still holds; unsandboxed, the process group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's own session: bwrap, or the plain interpreter
    except ProcessLookupError:
        pass
    if budget is not None:
        budget.kill()


def _tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and its descendants (Linux /proc; 0 where it cannot be read)."""
    from colo.host.shm import process_tree

    total = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    return total


def _communicate(proc: subprocess.Popen, data: bytes, deadline: float,
                 over: Callable[[], bool] | None = None) -> tuple[bytes, bytes, str | None]:
    """Write `data` to stdin, read stdout and stderr as they come; stop at the deadline ("timeout"), once stdout
    passed its bound ("output"), or once `over()` says the program's memory is past its budget ("memory", checked
    every WATCH_S). Never holds more than the bounds, however much the program writes."""
    out, err, cap = bytearray(), bytearray(), 4 * MAX_OUTPUT
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    view = memoryview(data)
    if view:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE, "in")
    else:
        proc.stdin.close()
    why = None
    try:
        while sel.get_map() and why is None:
            left = deadline - time.monotonic()
            if left <= 0:
                why = "timeout"
                break
            if over is not None and over():
                why = "memory"
                break
            for key, _ in sel.select(left if over is None else min(left, WATCH_S)):
                if key.data == "in":
                    try:
                        view = view[os.write(key.fd, view[:65536]):]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # the program ended without reading all of its code
                        view = view[len(view):]
                    if not view:
                        sel.unregister(key.fileobj)
                        key.fileobj.close()
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.data == "out":
                    out += chunk[:cap + 1 - len(out)]
                    if len(out) > cap:
                        why = "output"
                else:
                    err += chunk
                    del err[:-ERR_TAIL]
    finally:
        sel.close()
    return bytes(out), bytes(err), why


SYSTEM = ("You can run Python code. To run code, write <tool_call>{\"name\": \"python\", \"arguments\": "
          "{\"code\": \"...\"}}</tool_call>; you will get its printed output. When you know the answer, give it "
          "without a tool call, as \\boxed{answer}.")


def code_of(call: str) -> str:
    """A tool call's code: the JSON form's arguments.code, or the call's text itself."""
    call = call.strip()
    try:
        obj = json.loads(call)
    except ValueError:
        return call
    if isinstance(obj, dict) and isinstance(obj.get("arguments"), dict) and "code" in obj["arguments"]:
        return str(obj["arguments"]["code"])
    return call


class PythonEnv(Environment):
    """The built-in "python" environment: the row's prompt after a system message that explains the tool;
    every <tool_call> runs in run_python; a turn without one ends the conversation (algo.rewards score it)."""

    role = "tool"
    timeout_s = 10.0
    memory_mb = 1024

    def reset(self, row: dict) -> list[dict]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": str(row["prompt"])}]

    def step(self, turn: Turn) -> Step:
        calls = CALL.findall(turn.text)
        if not calls:
            return Step(None, 0.0, True)
        outs, errors = [], 0
        for call in calls:
            ran = run_python(code_of(call), self.timeout_s, self.memory_mb)
            outs.append(ran.stdout if ran.error is None else f"{ran.stdout}error: {ran.error}")
            errors += ran.error is not None
        return Step("\n".join(outs), 0.0, False, tool_calls=len(calls), tool_errors=errors)

    def solution(self, row: dict) -> list[str] | None:
        """For a prompt that holds an arithmetic expression (the CPU task, auto:calc): evaluate it as code, then
        answer with the result; None for other prompts."""
        found = [e for e in EXPRESSION.findall(str(row["prompt"])) if any(op in e for op in "+-*/")]
        if not found:
            return None
        return [f"<tool_call>{max(found, key=len).strip()}</tool_call>", str(row["answer"])]
