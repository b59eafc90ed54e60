"""Reward functions: built-ins and user functions by "module:function" or "file.py:function", run batched.

Every reward function has one batched signature

    fn(responses: list[str], answers: list[str], prompts: list[str]) -> list[float]

(same length as responses). A function may also declare keywords the text alone cannot show, and then receives
them: `finish_reasons: list[str]`, vLLM's finish reasons ("stop" / "length"); `response_ids: list[list[int]]`, the
token ids vLLM sampled (a conversation's: its last model turn, as the text), e.g. a reward by a property of the
tokens (colo.bench.stepreward).

Built-ins (names usable in `algo.rewards`):
    exact_match  1.0 when the extracted answer equals the reference (whitespace-normalized)
    numeric      1.0 when the last number in the response equals the reference's last number
                 within NUMERIC_REL_TOL / NUMERIC_ABS_TOL
    format       1.0 when the response stopped on its own (not truncated) with a non-empty answer
    math         1.0 when HF's math-verify finds the answer mathematically equal to the reference
                 (LaTeX, fractions, sets, intervals, units, \\boxed{}; colo.algo.math_reward)

`RewardRunner` resolves names once, at construction, so a typo fails before any GPU time is spent.
    runner(responses, answers, prompts)          -> list[float]  weighted sum, in the caller's thread
    runner.score(...)                            -> Scores       the sum and each function's values
    runner.submit(...)                           -> Future[Scores], scored in a worker thread so a
                                                    slow function (sandbox, HTTP judge) runs while the
                                                    driver does other work; .result() re-raises
A failing function raises `RewardError` naming the function and the sample; so does a user function that has
not returned after `timeout_s` (algo.reward_timeout_s), one that ends the process's way (`sys.exit()`, a
`KeyboardInterrupt` of its own: a run must not end with status 0 halfway), one that returns a value float32 cannot
hold (the rewards become a float32 tensor), and one that changes its inputs in place (each function gets its own
copies, compared after the call: the next function would score changed data and take the blame).
In the main thread (where the loop scores) a watchdog stops it with a signal, so it runs where signals work (math-verify's alarms, for one) and is really stopped;
elsewhere it runs in a daemon thread that is abandoned at the timeout. Built-ins bound themselves.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import re
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colo.algo import math_reward
from colo.run.signals import stop_signalled

RewardFn = Callable[..., list[float]]

FLOAT32_MAX = 3.4028234663852886e38  # the rewards become a float32 tensor (colo.loop.score): beyond this, inf
NUMERIC_REL_TOL = 1e-6
NUMERIC_ABS_TOL = 1e-6

# 1,234.5 / -3 / .5 / 2e-3 ; thousands separators are dropped before float()
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_MARKER = re.compile(r"(?:####|[Aa]nswer\s*[:=]|[Aa]nswer is)\s*(.+)")


class RewardError(RuntimeError):
    """A reward function failed; names the function and, when it can be found, the sample."""

    def __init__(self, message: str, fn_name: str, index: int | None = None,
                 response: str | None = None) -> None:
        super().__init__(message)
        self.fn_name = fn_name
        self.index = index
        self.response = response


def extract_answer(text: str) -> str:
    """The final answer of a response: last \\boxed{...}, else text after the last "####" /
    "Answer:" / "answer is", else the last non-empty line. Whitespace-normalized."""
    boxed = _BOXED.findall(text)
    if boxed:
        ans = boxed[-1]
    else:
        marked = _MARKER.findall(text)
        if marked:
            ans = marked[-1]
        else:
            lines = [ln for ln in text.splitlines() if ln.strip()]
            ans = lines[-1] if lines else ""
    return _norm(ans)


def _norm(text: str) -> str:
    """Collapse whitespace and drop a sentence-final period ("12." == "12")."""
    return " ".join(text.split()).rstrip(".")


def last_number(text: str) -> float | None:
    """The last number in `text`, or None."""
    for m in reversed(list(_NUMBER.finditer(text))):
        s = m.group(0)
        if any(c.isdigit() for c in s):
            try:
                return float(s.replace(",", ""))
            except ValueError:  # e.g. "1e" cut off by the regex alternatives
                continue
    return None


def exact_match(responses: list[str], answers: list[str], prompts: list[str]) -> list[float]:
    return [float(extract_answer(r) == _norm(a)) for r, a in zip(responses, answers)]


def math_answer(responses: list[str], answers: list[str], prompts: list[str]) -> list[float]:
    """The `math` reward: 1.0 when math-verify finds the response's final answer equal to the reference (or it matches
    exactly), else 0.0."""
    same = exact_match(responses, answers, prompts)
    return [float(v or s) for v, s in zip(math_reward.verified(responses, answers), same)]


def numeric(responses: list[str], answers: list[str], prompts: list[str]) -> list[float]:
    out = []
    for r, a in zip(responses, answers):
        got, want = last_number(r), last_number(a)
        ok = got is not None and want is not None and math.isclose(
            got, want, rel_tol=NUMERIC_REL_TOL, abs_tol=NUMERIC_ABS_TOL)
        out.append(float(ok))
    return out


def format(responses: list[str], answers: list[str], prompts: list[str],  # noqa: A001
           finish_reasons: list[str] | None = None) -> list[float]:
    reasons = finish_reasons or [None] * len(responses)
    return [float(fr in (None, "stop") and extract_answer(r) != "")
            for r, fr in zip(responses, reasons)]


BUILTINS: dict[str, RewardFn] = {"exact_match": exact_match, "numeric": numeric, "format": format,
                                 "math": math_answer}


def resolve(name: str) -> RewardFn:
    """A built-in name, "package.module:function" or "path/to/file.py:function" -> the callable. Raises ValueError
    naming it."""
    if ":" not in name:
        if name not in BUILTINS:
            raise ValueError(f"unknown reward function {name!r}: built-ins are {sorted(BUILTINS)}, "
                             "user functions are given as 'module:function' or 'path/to/file.py:function'")
        return BUILTINS[name]
    mod_name, _, attr = name.rpartition(":")
    try:
        mod = _load_file(mod_name) if mod_name.endswith(".py") else importlib.import_module(mod_name)
    except Exception as e:  # ImportError, or the module itself failing at import time
        raise ValueError(f"reward function {name!r}: cannot import {'file' if mod_name.endswith('.py') else 'module'} "
                         f"{mod_name!r}: {type(e).__name__}: {e}") from e
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function {name!r}: module {mod_name!r} has no callable {attr!r}")
    return fn


def _load_file(path: str) -> Any:
    """A reward module given by its file (verl's custom_reward_function.path, a script beside the config): loaded
    once per absolute path under a name of its own, so two files called rewards.py do not shadow each other."""
    import hashlib
    import importlib.util
    import sys

    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"no such file (from {os.getcwd()})")
    name = f"colo_reward_file_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:8]}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look their module up by name
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


@dataclass
class Scores:
    total: list[float]  # (N,) weighted sum over functions
    by_name: dict[str, list[float]]  # name -> (N,) unweighted, for per-function metrics


class RewardRunner:
    """Weighted sum of reward functions over a batch, in the caller's thread or a worker thread."""

    def __init__(self, names: Sequence[str], weights: Sequence[float] | None = None,
                 max_workers: int = 1, timeout_s: float | None = None) -> None:
        if not names:
            raise ValueError("at least one reward function is needed")
        if weights is not None and len(weights) != len(names):
            raise ValueError(f"{len(names)} reward functions but {len(weights)} weights")
        self.names = list(names)
        self.weights = [1.0] * len(names) if weights is None else [float(w) for w in weights]
        self.fns = [resolve(n) for n in self.names]
        self.timeout_s = timeout_s  # per call of a user function; None: no limit
        self._takes = [[kw for kw in KEYWORDS if _accepts(fn, kw)] for fn in self.fns]
        self._pool = ThreadPoolExecutor(max_workers, "colo-reward") if max_workers > 0 else None

    def __call__(self, responses: list[str], answers: list[str], prompts: list[str],
                 finish_reasons: list[str] | None = None, response_ids: list[list[int]] | None = None) -> list[float]:
        """(N,) weighted reward per sample."""
        return self.score(responses, answers, prompts, finish_reasons, response_ids).total

    def score(self, responses: list[str], answers: list[str], prompts: list[str],
              finish_reasons: list[str] | None = None, response_ids: list[list[int]] | None = None) -> Scores:
        n = len(responses)
        if len(answers) != n or len(prompts) != n:
            raise ValueError(f"{n} responses, {len(answers)} answers, {len(prompts)} prompts")
        given = {"finish_reasons": finish_reasons, "response_ids": response_ids}
        by_name: dict[str, list[float]] = {}
        total = [0.0] * n
        for name, fn, w, takes in zip(self.names, self.fns, self.weights, self._takes):
            kw = {k: given[k] for k in takes if given[k] is not None}
            limit = None if fn in BUILTINS.values() else self.timeout_s
            inputs = {"responses": responses, "answers": answers, "prompts": prompts, **kw}
            mine = {k: _copy(v) for k, v in inputs.items()}  # the function's own: what it changes stays its own
            vals = _run_one(name, fn, mine["responses"], mine["answers"], mine["prompts"],
                            {k: mine[k] for k in kw}, limit)
            _check_unchanged(name, inputs, mine)
            by_name[name] = vals
            total = [t + w * v for t, v in zip(total, vals)]
        for i, t in enumerate(total):
            if abs(t) > FLOAT32_MAX:
                raise RewardError(f"the weighted sum of the reward functions is {t:g} for sample {i}, beyond float32's "
                                  f"range (±{FLOAT32_MAX:.3g}) the rewards are kept in: "
                                  f"response={_short(responses[i])}; fix: scale the rewards down", "algo.rewards", i,
                                  responses[i])
        return Scores(total, by_name)

    def submit(self, responses: list[str], answers: list[str], prompts: list[str],
               finish_reasons: list[str] | None = None, response_ids: list[list[int]] | None = None) -> Future:
        """Score off the caller's thread; `.result()` gives Scores or raises RewardError."""
        if self._pool is None:
            fut: Future = Future()
            try:
                fut.set_result(self.score(responses, answers, prompts, finish_reasons, response_ids))
            except Exception as e:
                fut.set_exception(e)
            return fut
        return self._pool.submit(self.score, list(responses), list(answers), list(prompts),
                                 None if finish_reasons is None else list(finish_reasons),
                                 None if response_ids is None else list(response_ids))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


KEYWORDS = ("finish_reasons", "response_ids")
"""What a reward function receives besides the texts when it declares the keyword (module docstring)."""


def _accepts(fn: RewardFn, kw: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins / C callables without a signature
        return False
    return kw in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class _Timeout(BaseException):  # not an Exception: a reward function's own `except Exception` cannot swallow it
    pass


TIMEOUT_SIGNAL = signal.SIGUSR2  # sent by the watchdog to the main thread; nothing else in colo uses it


def _bounded(fn: RewardFn, timeout_s: float | None, *args: list[str], **kw: list[str]) -> list[float]:
    """fn(*args, **kw), or _Timeout once it has run timeout_s seconds."""
    if not timeout_s:
        return fn(*args, **kw)
    if threading.current_thread() is not threading.main_thread():  # no signals here: a thread to abandon
        box: dict = {}

        def target() -> None:
            try:
                box["value"] = fn(*args, **kw)
            except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
                box["error"] = e
        worker = threading.Thread(target=target, daemon=True, name="colo-reward")
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            raise _Timeout
        if "error" in box:
            raise box["error"]
        return box["value"]
    done = threading.Event()
    main = threading.main_thread().ident

    def watchdog() -> None:
        if not done.wait(timeout_s):
            signal.pthread_kill(main, TIMEOUT_SIGNAL)  # interrupts a blocking call too (sleep, socket, lock)

    def on_signal(signum: int, frame: object) -> None:
        if not done.is_set():
            raise _Timeout

    previous = signal.signal(TIMEOUT_SIGNAL, on_signal)
    dog = threading.Thread(target=watchdog, daemon=True, name="colo-reward-watchdog")
    dog.start()
    try:
        return fn(*args, **kw)
    finally:
        done.set()
        dog.join()  # no signal can come after this
        signal.signal(TIMEOUT_SIGNAL, previous)


def _timed_out(name: str, timeout_s: float) -> RewardError:
    return RewardError(f"reward function {name!r} did not return within {timeout_s:g} s (algo.reward_timeout_s); "
                       f"fix: make it return sooner (a timeout on its own calls to servers or sandboxes), or raise "
                       f"algo.reward_timeout_s", name)


def _run_one(name: str, fn: RewardFn, responses: list[str], answers: list[str],
             prompts: list[str], kw: dict, timeout_s: float | None = None) -> list[float]:
    try:
        vals = _bounded(fn, timeout_s, responses, answers, prompts, **kw)
    except _Timeout:
        raise _timed_out(name, timeout_s) from None
    except BaseException as e:
        if not _its_own(e):  # a stop signal (Ctrl-C, SIGTERM, SIGHUP) that came while it ran: the run stops
            raise
        raise _locate(name, fn, responses, answers, prompts, kw, e, timeout_s) from e
    try:
        vals = [float(v) for v in vals]
    except (TypeError, ValueError) as e:
        raise RewardError(f"reward function {name!r} returned non-numeric values: {e}", name) from e
    if len(vals) != len(responses):
        raise RewardError(f"reward function {name!r} returned {len(vals)} values for "
                          f"{len(responses)} responses", name)
    for i, v in enumerate(vals):
        if not math.isfinite(v):
            raise RewardError(f"reward function {name!r} returned {v} for sample {i}: "
                              f"response={_short(responses[i])}", name, i, responses[i])
        if abs(v) > FLOAT32_MAX:
            raise RewardError(f"reward function {name!r} returned {v:g} for sample {i}, beyond float32's range "
                              f"(±{FLOAT32_MAX:.3g}) the rewards are kept in: response={_short(responses[i])}; fix: "
                              "return values of a sane scale", name, i, responses[i])
    return vals


def _its_own(e: BaseException) -> bool:
    """An exception the reward function raised itself: any Exception, SystemExit (sys.exit() ends a run with
    status 0), and a KeyboardInterrupt no stop signal caused (colo.run.signals.stop_signalled)."""
    if isinstance(e, KeyboardInterrupt):
        return not stop_signalled()
    return isinstance(e, (Exception, SystemExit))


def _raised(e: BaseException) -> str:
    """How a reward function's exception reads: "called sys.exit(0)" for a SystemExit, else "raised <Type>: ..."."""
    if isinstance(e, SystemExit):
        return f"called sys.exit({e.code!r}) (a reward function cannot end the run; return a value or raise)"
    return f"raised {type(e).__name__}: {e}"


def _locate(name: str, fn: RewardFn, responses: list[str], answers: list[str],
            prompts: list[str], kw: dict, err: BaseException, timeout_s: float | None = None) -> RewardError:
    """Find the first sample that makes `fn` raise by calling it one sample at a time.

    Reward functions are meant to be pure scorers, so re-running them is safe; a function that
    fails on the batch but on no single sample is reported without an index.
    """
    for i in range(len(responses)):
        one_kw = {k: v[i:i + 1] for k, v in kw.items()}
        try:
            _bounded(fn, timeout_s, responses[i:i + 1], answers[i:i + 1], prompts[i:i + 1], **one_kw)
        except _Timeout:
            return _timed_out(name, timeout_s)
        except BaseException as e:
            if not _its_own(e):
                raise
            return RewardError(
                f"reward function {name!r} {_raised(e)} on sample {i}: "
                f"response={_short(responses[i])} answer={_short(answers[i])}",
                name, i, responses[i])
    return RewardError(f"reward function {name!r} {_raised(err)} on the batch "
                       f"of {len(responses)} (no single sample reproduces it)", name)


def _copy(values: list) -> list:
    """A list of strs as a new list; of lists (response_ids) as new lists too."""
    return [list(v) if isinstance(v, list) else v for v in values]


def _check_unchanged(name: str, inputs: dict[str, list], given: dict[str, list]) -> None:
    """RewardError when the function changed the lists it was given (its copies, `given`) in place: a pure scorer
    does not, and one that does would leave the next function, or its own retry on one sample, other data."""
    for key, values in inputs.items():
        got = given[key]
        if len(got) != len(values):
            raise RewardError(f"reward function {name!r} changed its input {key} in place (its length {len(values)} "
                              f"-> {len(got)}); fix: copy what it changes (e.g. {key} = list({key}))", name)
        for i, (a, b) in enumerate(zip(values, got)):
            if a != b:
                raise RewardError(f"reward function {name!r} changed its input {key}[{i}] in place, on sample {i}: "
                                  f"{_short(str(a))} -> {_short(str(b))}; fix: copy what it changes (e.g. {key} = "
                                  f"list({key}))", name, i)


def _short(text: str, limit: int = 200) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
