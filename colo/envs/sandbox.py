"""Model-written Python, run where it can do no harm to the run: a subprocess, never the driver or an engine.

    r = run_python("print(2**10)", timeout_s=5, memory_mb=512)   # Ran(stdout="1024\n", error=None, ...)

The child is a fresh interpreter in isolated mode (-I: no site-packages of the user, no PYTHON* variables)
in an empty temporary directory that is removed afterwards, with resource limits set before it starts:
address space (memory_mb), CPU seconds, file size (16 MiB), open files; it runs in a session of its own, so
a timeout kills it and everything it started (by its own process group id). Output is cut at
MAX_OUTPUT characters. This is containment for a model's mistakes (an infinite loop, a huge list), not a
security boundary against a hostile program: it can still read what the user running colo can read.

The "python" environment (PythonEnv) runs the code of every <tool_call> and answers with its output:

    <tool_call>print(sum(range(10)))</tool_call>     or   <tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from colo.envs.base import Environment, Step, Turn
from colo.envs.calculator import CALL

MAX_OUTPUT = 2000


@dataclass
class Ran:
    stdout: str
    error: str | None  # None: exit 0; else the last line of stderr, "timed out after ..", or the signal
    returncode: int | None


# The child sets its own limits before it reads the code: a preexec_fn would run between fork and exec in a
# process with threads (an engine's), which Python documents as unsafe.
PRELUDE = """import resource, sys
mem, cpu = int(sys.argv[1]) * 2**20, int(sys.argv[2])
for what, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, 16 * 2**20),
                    (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(what, (value, value))
code = sys.argv[3]
del resource, mem, cpu, what, value
sys.argv = ["tool"]
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""


def run_python(code: str, timeout_s: float = 10.0, memory_mb: int = 1024) -> Ran:
    """Run `code` in a fresh interpreter under the limits above; wall-clock `timeout_s`."""
    cpu_s = max(1, int(timeout_s) + 1)
    with tempfile.TemporaryDirectory(prefix="colo-sandbox-") as tmp:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", PRELUDE, str(memory_mb), str(cpu_s), code], cwd=tmp, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True,
            env={"PATH": "/usr/bin:/bin", "HOME": tmp, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"})
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: it and whatever it started
            out, err = proc.communicate()
            return Ran(out[:MAX_OUTPUT], f"timed out after {timeout_s:g} s", None)
    if proc.returncode == 0:
        return Ran(out[:MAX_OUTPUT], None, 0)
    if proc.returncode < 0:
        why = f"killed by {signal.Signals(-proc.returncode).name}"
        if -proc.returncode == signal.SIGXCPU:
            why += " (CPU time limit)"
        return Ran(out[:MAX_OUTPUT], why, proc.returncode)
    last = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    return Ran(out[:MAX_OUTPUT], last[:MAX_OUTPUT], proc.returncode)


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
