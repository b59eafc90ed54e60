"""The `math` reward: answer checking with Hugging Face's math-verify (LaTeX, fractions, sets, intervals,
units, \\boxed{} extraction), where colo's regex rewards compare strings or last numbers.

    algo.rewards: [math]                 # 1.0 when the response's answer equals the reference mathematically

    verified(["... so the answer is \\boxed{\\frac{1}{2}}"], ["0.5"])  -> [True]   (exact_match: 0.0)

Where the checks run: math-verify bounds each parse and comparison with signal.alarm (sympy can take
minutes on a pathological expression), and signals work only in a process's main thread. Called from the
main thread (the loop scores there), the checks run right here and math-verify's own timeouts hold. Called
from another thread (RewardRunner.submit), they run in worker processes instead, where they are the main
thread. That pool is started once ("spawn": never fork a process that runs Ray and vLLM threads) and
reused; spawn re-imports the caller's __main__, so a script that calls this off its main thread needs its
code under `if __name__ == "__main__":`, and a pool that breaks for want of one says so.

The reference answer is parsed as LaTeX (wrapped in \\boxed{} unless it has its own \\boxed or $...$; of a
GSM8K solution, only the part after its final "####"),
so "\\{1,2\\}", "\\sqrt{8}" or "x^2+1" work as plain dataset answers. A sample also scores 1.0 when colo's
exact_match does: a non-math answer ("blue") parses as a product of symbols, or not at all, and string
equality is then the only sensible check.
"""
from __future__ import annotations

import atexit
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

WORKERS = 2  # math-verify is pure Python: one process per core of the 2-core default host is plenty
TIMEOUT_S = 5  # per parse and per comparison (math-verify's own default); a timeout scores 0
_pool: ProcessPoolExecutor | None = None


def _get_pool() -> ProcessPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ProcessPoolExecutor(WORKERS, mp_context=multiprocessing.get_context("spawn"))
        atexit.register(_pool.shutdown, wait=False, cancel_futures=True)
    return _pool


def _gold_latex(answer: str) -> str:
    """The reference as LaTeX math-verify reads. GSM8K-style references (a worked solution ending in
    "#### 72") contribute what follows the last "####"."""
    if "####" in answer:
        answer = answer.rpartition("####")[2].strip().replace(",", "")
    return answer if ("\\boxed" in answer or "$" in answer) else f"\\boxed{{{answer}}}"


def _grade(pairs: list[tuple[str, str]]) -> list[bool]:
    """In a worker process: per (response, answer), whether math-verify finds them equal."""
    from math_verify import parse, verify

    out = []
    for response, answer in pairs:
        gold = parse(_gold_latex(answer), parsing_timeout=TIMEOUT_S)
        pred = parse(response, parsing_timeout=TIMEOUT_S) if gold else []
        out.append(bool(pred) and verify(gold, pred, timeout_seconds=TIMEOUT_S))
    return out


def verified(responses: list[str], answers: list[str]) -> list[bool]:
    """Per response, whether math-verify finds its final answer equal to the reference (graded in the
    process pool; colo.algo.rewards.math adds exact matches on top)."""
    pairs = list(zip(responses, answers))
    if threading.current_thread() is threading.main_thread():  # signal.alarm works here: no pool needed
        return _grade(pairs)
    per = -(-len(pairs) // WORKERS) or 1
    chunks = [pairs[i: i + per] for i in range(0, len(pairs), per)]
    try:
        return [v for fut in [_get_pool().submit(_grade, c) for c in chunks] for v in fut.result()]
    except BrokenProcessPool as e:
        raise RuntimeError("the math reward's worker processes died at start; a script that scores off its main "
                           "thread is re-imported by them (multiprocessing spawn); fix: put the script's code under "
                           "`if __name__ == \"__main__\":`, or score from the main thread") from e
