"""Synthetic verifiable tasks, generated locally and deterministically (no downloads).

    python -m colo.data.tasks arith /tmp/colo-data --n-train 2000 --n-eval 200 --seed 0
    # -> /tmp/colo-data/arith_train.jsonl, /tmp/colo-data/arith_eval.jsonl ({"prompt": ..., "answer": ...})

Tasks (kept EASY: a 2-layer tiny model after a short supervised warm-up should be partly right, so
RL can visibly lift accuracy):
- `arith`:   "Question: 3+4=? Answer:" -> "7". Single-digit operands, + and -; for - the larger operand
  comes first, so every answer is 0..18 (1-2 digit tokens with colo.models.tokenizer).
- `reverse`: "Question: reverse abc Answer:" -> "cba". Three letters from a-h.
- `calc`:    "Calculate 47*12+35." -> "599": two-digit operands, too much for the tiny model to compute
  in its head, and one copy away with the calculator tool (algo.environment=calculator,
  configs/tiny-cpu-tools.yaml): call it on the expression, answer with what it says. A fixed draw of 5000 of
  the 729,000 problems; the eval split holds out a disjoint fifth of them.

The model's completion is the answer after one space (" 7") for a raw prompt, and the bare answer
("7") inside a chat template: `completion(answer, chat_template)` gives the exact text to train on
in the warm-up. `colo.algo.rewards.exact_match` scores both forms (it normalizes whitespace).

Held-out eval: `arith` has only 155 distinct problems, so train and eval are independent draws
from the same distribution (separate RNG streams) and overlap in problems: eval accuracy measures
how well the model knows the table, not generalization. `reverse` has 512 strings; its eval split
holds out a disjoint set of strings, so it measures generalization of the copy-reversed skill.
"""
from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Callable
from pathlib import Path

Example = tuple[str, str]  # (prompt, answer)


def _arith_problems() -> list[Example]:
    out = []
    for a in range(10):
        for b in range(10):
            out.append((f"Question: {a}+{b}=? Answer:", str(a + b)))
    for a in range(10):
        for b in range(a + 1):
            out.append((f"Question: {a}-{b}=? Answer:", str(a - b)))
    return out  # 100 sums + 55 differences


def _reverse_problems() -> list[Example]:
    letters = "abcdefgh"
    words = [x + y + z for x in letters for y in letters for z in letters]
    return [(f"Question: reverse {w} Answer:", w[::-1]) for w in words]


def _calc_problems() -> list[Example]:
    rng = random.Random("calc-table")  # a fixed sample of the 90**3 problems: the table stays small
    out = []
    for _ in range(5000):
        a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(10, 99)
        out.append((f"Calculate {a}*{b}+{c}.", str(a * b + c)))
    return out


# name -> (problem table, disjoint eval split?)
TASKS: dict[str, tuple[Callable[[], list[Example]], bool]] = {
    "arith": (_arith_problems, False),
    "reverse": (_reverse_problems, True),
    "calc": (_calc_problems, True),
}


def completion(answer: str, chat_template: bool) -> str:
    """The exact response text for `answer` (EOS not included: append the tokenizer's eos)."""
    return answer if chat_template else " " + answer


def generate(name: str, n_train: int, n_eval: int, seed: int) -> tuple[list[Example], list[Example]]:
    """Train and eval examples for task `name`; same arguments give the same lists."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {sorted(TASKS)}")
    if n_train < 0 or n_eval < 0:
        raise ValueError(f"n_train and n_eval must be >= 0, got {n_train}, {n_eval}")
    table_fn, disjoint = TASKS[name]
    table = table_fn()
    # String seeds hash with sha512 in `random`, so streams are stable across runs and Python versions.
    if disjoint:
        order = list(table)
        random.Random(f"{name}:{seed}:split").shuffle(order)
        n_held = min(max(len(order) // 5, 1), len(order) - 1)
        eval_pool, train_pool = order[:n_held], order[n_held:]
    else:
        eval_pool = train_pool = table
    train_rng = random.Random(f"{name}:{seed}:train")
    eval_rng = random.Random(f"{name}:{seed}:eval")
    train = [train_rng.choice(train_pool) for _ in range(n_train)]
    evals = [eval_rng.choice(eval_pool) for _ in range(n_eval)]
    return train, evals


def _write_jsonl(path: Path, rows: list[Example]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        for prompt, answer in rows:
            f.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")
    os.replace(tmp, path)  # readers never see a half-written file


N_TRAIN, N_EVAL = 2000, 200  # the rows a run's auto: task holds


def task_rows(name: str, split: str, seed: int = 0) -> list[dict]:
    """The rows ({"prompt", "answer"}) of split "train" or "eval" that make_task writes, made in memory."""
    train, evals = generate(name, N_TRAIN, N_EVAL, seed)
    return [{"prompt": p, "answer": a} for p, a in (train if split == "train" else evals)]


def make_task(name: str, out_dir: str | os.PathLike, n_train: int = N_TRAIN, n_eval: int = N_EVAL,
              seed: int = 0) -> tuple[Path, Path]:
    """Write `{name}_train.jsonl` and `{name}_eval.jsonl` into out_dir; returns their paths."""
    train, evals = generate(name, n_train, n_eval, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_path, eval_path = out / f"{name}_train.jsonl", out / f"{name}_eval.jsonl"
    _write_jsonl(train_path, train)
    _write_jsonl(eval_path, evals)
    return train_path, eval_path


def sft_examples(path: str | os.PathLike, prompt_key: str = "prompt",
                 answer_key: str = "answer") -> list[Example]:
    """(prompt, answer) pairs from a task file (JSONL or Parquet) for the supervised warm-up; a prompt is text or
    chat messages (colo.data.prompts.Prompt)."""
    from colo.data.prompts import read_examples

    return read_examples(path, prompt_key, answer_key)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="write a synthetic task's train/eval JSONL")
    ap.add_argument("name", choices=sorted(TASKS))
    ap.add_argument("out_dir")
    ap.add_argument("--n-train", type=int, default=2000)
    ap.add_argument("--n-eval", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    for p in make_task(a.name, a.out_dir, a.n_train, a.n_eval, a.seed):
        print(p)


if __name__ == "__main__":
    main()
