"""Environment code the driver needs, run in a process of its own: the driver never runs an environment.

    with EnvWorker("python", tokenizer, system_prompt=None, chat=True) as w:
        firsts = w.first_prompts(rows)        # ids of each row's first turn (reset()'s messages), or an error
        demos = w.demonstrations(rows)        # each row's demonstration as a sample (Environment.solution), or None

The driver needs an environment twice: at launch, to count the tokens of every row's first turn (reset()
may add a system message: the length check must see what vLLM will get), and in the supervised warm-up, whose
examples are the environment's demonstrations with its real answers (a tool call run, its output framed).
Both run environment and tool code (a user's module:Class, or model-format code through the Python tool), and
code that kills its process (os.kill(os.getppid(), 9), os._exit, a segfault in an extension) must not take the
driver with it. So they run in a spawned worker process (a fresh interpreter: no Ray, no threads of the
driver's) that holds the environment class, the tokenizer and the chat framing; a worker that dies is named in
an EnvError, which ends the run with one `colo: error:` line (or, at launch, refuses it).
"""
from __future__ import annotations

import multiprocessing
import weakref
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from colo.envs.base import EnvError
from colo.run.signals import stop_signalled

_STATE: dict[str, Any] = {}  # in the worker: the environment class and the framing


def _init(spec: str, tokenizer: Any, system_prompt: str | None, chat: bool, unsafe_tools: bool) -> None:
    from colo.envs.base import load_environment
    from colo.envs.framing import ChatFraming
    from colo.envs.sandbox import permit_unsandboxed

    permit_unsandboxed(unsafe_tools)
    _STATE["cls"] = load_environment(spec)
    _STATE["framing"] = ChatFraming(tokenizer, system_prompt if chat else None, chat)


def _first_prompts(rows: list[dict]) -> list[list[int] | str]:
    from colo.envs.runner import EnvRunner, ended_as

    out: list[list[int] | str] = []
    for row in rows:
        try:
            out.append(EnvRunner(_STATE["cls"], _STATE["framing"]).reset(row))
        except Exception as e:  # noqa: BLE001 (a user environment may raise anything: named with its row)
            out.append(f"{type(e).__name__}: {e}")
        except (SystemExit, KeyboardInterrupt) as e:  # the environment's own: no signal reaches a pool worker's call
            out.append(ended_as(e))
    return out


def _demonstrations(rows: list[dict]) -> list[dict | None]:
    from colo.envs.base import Turn
    from colo.envs.framing import Conversation
    from colo.envs.runner import EnvRunner

    framing, out = _STATE["framing"], []
    for row in rows:
        runner = EnvRunner(_STATE["cls"], framing)
        conv = Conversation(runner.reset(row))
        turns = runner.env.solution(row) if hasattr(runner.env, "solution") else None
        if not turns:
            out.append(None)
            continue
        for t, text in enumerate(turns):
            ids = framing.encode(text) + [framing.eos_id]
            conv.add_model(ids, [0.0] * len(ids))
            step, obs = runner.step(Turn(text, tuple(ids), t, "stop"), after_eos=True)
            if step.done:
                break
            conv.add_env(obs)
        out.append({"prompt_ids": conv.prompt_ids, "response_ids": conv.response_ids, "logprobs": conv.logprobs,
                    "model_mask": conv.model_mask})
    return out


class EnvWorker:
    """One spawned process holding environment `spec`; calls block until it answers. Stopped by close(), or
    when the object is collected."""

    def __init__(self, spec: str, tokenizer: Any, system_prompt: str | None = None, chat: bool = True,
                 unsafe_tools: bool = False) -> None:
        self.spec = spec
        self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_init,
                                        initargs=(spec, tokenizer, system_prompt, chat, unsafe_tools))
        self._finalizer = weakref.finalize(self, self.pool.shutdown, wait=True, cancel_futures=True)

    def _call(self, fn: Any, rows: list[dict], what: str) -> list:
        try:
            return self.pool.submit(fn, rows).result()
        except BrokenProcessPool as e:
            self.close()
            raise EnvError(f"environment {self.spec}: its process died while {what} (the driver runs environment "
                           "code in a process of its own; something in reset, solution or step ended it: "
                           "os.kill, os._exit, a crash)") from e
        except EnvError:
            raise
        except Exception as e:  # noqa: BLE001 (raised by the environment: one line with its type)
            raise EnvError(f"environment {self.spec}: {type(e).__name__} while {what}: {e}") from e
        except (SystemExit, KeyboardInterrupt) as e:  # the worker's, handed back: would end the driver as it says
            if isinstance(e, KeyboardInterrupt) and stop_signalled():  # a stop signal while the driver waited
                raise
            from colo.envs.runner import ended_as

            raise EnvError(f"environment {self.spec}: while {what}, {ended_as(e)}") from e

    def first_prompts(self, rows: list[dict]) -> list[list[int] | str]:
        """Each row's first-turn ids (reset() framed as the engine frames it), or the error reset() gave."""
        return self._call(_first_prompts, rows, "making the first prompts")

    def demonstrations(self, rows: list[dict]) -> list[dict | None]:
        """Each row's demonstration (Environment.solution run through step()), or None where it has none."""
        return self._call(_demonstrations, rows, "building the warm-up's demonstrations")

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> EnvWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
