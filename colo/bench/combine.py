"""Several colo.bench.step comparisons, one ratio with its spread: pools the pairs of blocks of every call.

    python -m colo.bench.combine async-1.json async-2.json async-3.json          # lines
    python -m colo.bench.combine --json --goal 1.4 out/*/async.json              # one JSON object

Each FILE is what one `colo.bench.step --compare KEY=A,B --json` call printed (its stdout, or just its last JSON
line): the last JSON line of the file is taken, the one written after the call's last whole repeat. Every call must
compare the same KEY=A,B. Reported (colo.bench.spread):
- "pairs": A over B per pair of blocks (one pair per repeat of each call), pooled over the calls: median,
  quartiles, min, max, and whether every pair lies on one side of 1;
- "calls": each call's own ratio (its tokens over its seconds, per variant) and their median, min and max: the
  figure issue 47 asks for is this median over at least three calls, with its spread;
- "train_speedup": B's train seconds per token over A's, per pair;
- "per_step": every measured step's tokens/s/GPU per variant, pooled.
A call printed before --repeats existed (no "blocks") counts as one pair: its two variants' totals.
--goal G adds whether the median of the calls, and every call, reach G.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from colo.bench.spread import compare, describe, spread


def last_json(path: str | Path) -> dict:
    """The last line of the file that is a JSON object (what colo.bench.step --json printed last)."""
    found = None
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                found = json.loads(line)
            except ValueError:  # a line cut short by a time limit
                continue
    if found is None:
        raise ValueError(f"{path}: no JSON line (colo.bench.step --json prints one after every repeat)")
    return found


def blocks_of(out: dict, call: int) -> list[dict]:
    """The call's blocks, each marked with the call; an output without blocks (before --repeats) gives one block per
    variant from its totals (tokens_per_step x steps, phases x steps)."""
    if "blocks" in out:
        return [{**b, "call": call} for b in out["blocks"]]
    a, b = out["compare"]["values"]
    made = []
    for value, r in ((a, out), (b, out["versus"])):
        steps = r["steps"]
        step_s, tokens = r["phases"]["step"] * steps, r["tokens_per_step"] * steps
        made.append({"variant": value, "repeat": 0, "call": call, "gpus": out["gpus"], "steps": steps,
                     "tokens": tokens, "step_s": step_s, "train_s": r["phases"]["train"] * steps,
                     "rollout_s": r["phases"]["rollout"] * steps, "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"],
                     "train_s_per_mtok": 1e6 * r["phases"]["train"] * steps / tokens,
                     "step_tokens_per_s_per_gpu": [], "step_train_s": [], "step_tokens": []})
    return made


def combine(outputs: list[dict], goal: float | None = None) -> dict:
    """The pooled comparison of several calls' outputs (module docstring)."""
    if not outputs:
        raise ValueError("no outputs to combine")
    keys = {(o["compare"]["key"], tuple(o["compare"]["values"])) for o in outputs if "compare" in o}
    if len(keys) != 1 or any("compare" not in o for o in outputs):
        raise ValueError(f"every call must compare the same KEY=A,B; got {sorted(map(str, keys)) or 'no --compare'}")
    (key, (a, b)), = keys
    blocks = [bl for i, o in enumerate(outputs) for bl in blocks_of(o, i)]
    out = {"key": key, **compare(blocks, a, b)}
    per_call = []
    for i in range(len(outputs)):
        st = compare([bl for bl in blocks if bl["call"] == i], a, b)
        per_call.append(st["ratio_of_totals"])
    out["calls"] = {"ratios": per_call, **spread(r for r in per_call if r is not None)}
    if goal is not None:
        got = [r for r in per_call if r is not None]
        out["goal"] = {"value": goal, "median_reached": bool(got) and out["calls"]["median"] >= goal,
                       "every_call_reached": bool(got) and len(got) == len(per_call) and min(got) >= goal}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m colo.bench.combine", description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="colo.bench.step --compare --json outputs, one per call")
    ap.add_argument("--goal", type=float, help="a ratio the median of the calls should reach, e.g. 1.4")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    args = ap.parse_args(argv)
    try:
        out = combine([last_json(f) for f in args.files], args.goal)
    except (OSError, ValueError, KeyError) as e:
        print(f"colo: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, sort_keys=True))
        return 0
    c = out["calls"]
    print(f"{out['key']}: " + describe(out))
    print(f"per call ({c['n']}): " + ", ".join(f"{r:.3f}x" for r in c["ratios"] if r is not None)
          + (f"; median {c['median']:.3f}x (min {c['min']:.3f}, max {c['max']:.3f})" if c["n"] else ""))
    for v, st in out["per_step"].items():
        if st["n"]:
            print(f"  {v}: per-step tokens/s/GPU median {st['median']:.0f} (q1 {st['q1']:.0f}, q3 {st['q3']:.0f}, "
                  f"min {st['min']:.0f}, max {st['max']:.0f}, {st['n']} steps)")
    if "goal" in out:
        g = out["goal"]
        print(f"goal {g['value']}x: median of the calls {'reached' if g['median_reached'] else 'not reached'}; "
              f"every call {'reached' if g['every_call_reached'] else 'not reached'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
