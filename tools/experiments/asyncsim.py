"""What loop.mode=async (colocated) could gain in steady state, from a measured decode curve: a model, not a measurement.

    python -m tools.experiments.asyncsim --decode-json decode.json --oversample 3 --staleness 3 --steps 30 --json

Why: one GPU call of colo.bench.step measures 2-3 async steps after a cold start, where every group starts at once
and the steps alternate between long rollouts and nearly free ones; the steady state the async step is for (groups
at staggered stages, the batch kept full) needs tens of steps, more than a call holds. This replays the async step's
own bookkeeping (colo.rollout.buffer.RolloutBuffer: drop stale groups, top up to oversample x prompts, stop once
enough whole groups finished, carry the rest, take whole groups) for many steps, with every sample's length drawn
as the step benchmark imposes it (colo.bench.lengths) and each phase's time from colo.bench.decode's measured
curve: the decode steps (step_time(active sequences) for each step the phase runs), plus the re-prefill of every
carried sample (prompt + its tokens) and the new prompts at the measured prefill cost, plus --train-s-per-token x
trained tokens and --fixed-s per step (sleep, sync, wake). Sync runs the same way: every step k new groups decoded
to their longest sample.

What it leaves out: vLLM's scheduler (chunked prefill mixed into decode steps, preemption), the growth of a step's
attention cost with the context, and the rollout's spread between runs (15-21 s for the same samples on GPU).
Use it to choose what a GPU call should measure (oversample, staleness, how many steps), not as a figure.

    python -m tools.experiments.asyncsim --shapes 32768 --max-tokens 2048 --oversample 3 --staleness 3 --steps 300

--shapes BUDGET needs no decode curve: what each mode's steps hand the trainer (colo.algo.packing's micro-batches
at that token budget): trained tokens per step, micro-batches per step, the attention work per token (sum of L^2
over tokens). The train phase's cost follows these shapes and nothing else of a batch (a batch of stale tokens
trains as fast as a fresh one of the same shapes, measured: issue 47), so they bound what the async step's batches
can cost the train phase over sync's.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Sequence

from colo.bench.decode import TOKEN_ID_LIMIT, step_time
from colo.bench.lengths import LENGTH_MODELS, LengthModel
from colo.rollout.buffer import RolloutBuffer
from colo.rollout.sample import Status


def decode_phase(remaining: Sequence[int], groups: Sequence[int], need: int,
                 table: Sequence[tuple[int, float]]) -> tuple[int, float]:
    """Decode steps until `need` more groups have all their samples done, and their seconds.

    remaining[i]: tokens request i still has to generate; groups[i]: its group. A group with no request here is
    not counted (it is complete already or not in this phase). Returns (steps D, seconds); every request then
    generated min(remaining, D) tokens."""
    if need <= 0 or not remaining:
        return 0, 0.0
    done_at: dict[int, int] = {}
    for r, g in zip(remaining, groups):
        done_at[g] = max(done_at.get(g, 0), r)
    steps = sorted(done_at.values())[min(need, len(done_at)) - 1]
    ordered, seconds, k = sorted(remaining), 0.0, 0
    for t in range(steps):
        while k < len(ordered) and ordered[k] <= t:
            k += 1
        seconds += step_time(len(ordered) - k, table)
    return steps, seconds


def simulate(mode: str, steps: int, k: int, n: int, max_tokens: int, prompt_len: int, model: LengthModel,
             table: Sequence[tuple[int, float]], prefill_s_per_token: float, train_s_per_token: float,
             fixed_s: float, oversample: float = 1.5, max_staleness: int = 1, warmup: int = 0,
             seed: int = 0) -> dict:
    """Per-step figures of `steps` steps (after `warmup`) of mode "sync" or "async" (colo.rollout.schedule.Carried's
    bookkeeping with RolloutBuffer), and their totals."""
    rng = random.Random(seed)
    buf = RolloutBuffer(n, max_staleness if mode == "async" else 0)
    length: dict[tuple[int, int], int] = {}  # (group id, sample) -> imposed length
    rows = []
    for step in range(warmup + steps):
        buf.drop_stale(step)
        want = buf.wanted(math.ceil(oversample * k) if mode == "async" else k)
        if want:
            first = buf.next_id
            buf.add([{"prompt_ids": [rng.randrange(3, TOKEN_ID_LIMIT) for _ in range(prompt_len)]}
                     for _ in range(want)], seed=step * 1_000_003)
            for gid in range(first, buf.next_id):
                g = buf.groups[gid]
                for j, s in enumerate(g.samples):
                    length[gid, j] = model.length(s.seed, max_tokens, g.prompt["prompt_ids"])
        reqs = buf.requests()
        left = [length[r.group, r.index] - len(r.response_ids) for r in reqs]
        need = buf.need(k) if mode == "async" else len(buf.groups)
        d, decode_s = decode_phase(left, [r.group for r in reqs], need, table)
        prefill = sum(len(r.prompt_ids) + len(r.response_ids) for r in reqs) if d else 0
        for r, x in zip(reqs, left):  # what the engine loop makes of each request (colo.rollout.engine_loop)
            r.extend([0] * min(x, d), [0.0] * min(x, d), step)
            r.status, r.segments = Status.COMPLETED if x <= d else r.status, r.segments + 1
        buf.absorb(reqs)
        _, samples = buf.take(k, step)
        trained = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        rollout_s = decode_s + prefill * prefill_s_per_token
        step_s = rollout_s + trained * train_s_per_token + fixed_s
        if step >= warmup:
            rows.append({"step": step, "decode_steps": d, "rollout_s": rollout_s, "step_s": step_s,
                         "trained_tokens": trained, "prefill_tokens": prefill, **buf.counts,
                         "lengths": [len(s.prompt_ids) + len(s.response_ids) for s in samples]})
    total_s = sum(r["step_s"] for r in rows)
    return {"mode": mode, "steps": rows,
            "tokens_per_s": sum(r["trained_tokens"] for r in rows) / total_s if total_s else float("nan"),
            "rollout_s_mean": sum(r["rollout_s"] for r in rows) / len(rows),
            "step_s_mean": total_s / len(rows),
            "dropped_tokens": sum(r["dropped_tokens"] for r in rows)}


def train_shapes(rows: Sequence[dict], budget: int) -> dict:
    """What the trainer gets over simulate()'s steps: trained tokens per step (mean, sd, min, max), micro-batches per
    step at `budget` tokens (colo.algo.packing.pack_bins: mean and how many steps had each count), and the attention
    work per trained token (sum of L^2 over the tokens)."""
    from statistics import mean, pstdev

    from colo.algo.packing import pack_bins

    tokens = [sum(r["lengths"]) for r in rows]
    bins = [len(pack_bins(r["lengths"], budget)) for r in rows]
    return {"tokens_mean": mean(tokens), "tokens_sd": pstdev(tokens), "tokens_min": min(tokens),
            "tokens_max": max(tokens), "micro_batches_mean": mean(bins),
            "micro_batches": {str(k): bins.count(k) for k in sorted(set(bins))},
            "attention_per_token": sum(x * x for r in rows for x in r["lengths"]) / sum(tokens)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.experiments.asyncsim", description=__doc__.splitlines()[0])
    ap.add_argument("--decode-json", help="a colo.bench.decode JSON line (its step_ms and prefill); not needed with "
                    "--shapes")
    ap.add_argument("--shapes", type=int, metavar="BUDGET", help="the trainer's shapes per mode instead, micro-batches "
                    "at this token budget (trainer.max_tokens_per_micro_batch)")
    ap.add_argument("--prompts", type=int, default=16, help="data.prompts_per_step (k)")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--lengths", choices=LENGTH_MODELS, default="iid")
    ap.add_argument("--length-rho", type=float, default=None)
    ap.add_argument("--oversample", type=float, default=1.5)
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30, help="measured steps")
    ap.add_argument("--warmup", type=int, default=10, help="steps before them (the cold start)")
    ap.add_argument("--train-s-per-token", type=float, default=2.90 / 188_741,
                    help="train phase seconds per trained token (default: the compiled L4 train phase on an H200)")
    ap.add_argument("--fixed-s", type=float, default=0.5, help="seconds per step outside rollout and train")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.oversample < 1 or args.staleness < 0 or min(args.steps, args.prompts, args.n, args.max_tokens) < 1:
        ap.error("--oversample >= 1, --staleness >= 0, and --steps, --prompts, --n, --max-tokens >= 1")
    if args.decode_json is None and args.shapes is None:
        ap.error("give --decode-json (the timing model), or --shapes BUDGET (the train shapes alone)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = LengthModel.of(args.lengths, args.length_rho)
    if args.shapes is not None:
        return show_shapes(args, model)
    with open(args.decode_json) as f:
        dec = json.loads([line for line in f if line.startswith("{")][-1])
    table = [(int(b), ms / 1e3) for b, ms in dec["step_ms"].items()]
    prefill = dec["prefill_us_per_token"] / 1e6
    common = dict(steps=args.steps, k=args.prompts, n=args.n, max_tokens=args.max_tokens, prompt_len=args.prompt_len,
                  model=model, table=table, prefill_s_per_token=prefill, train_s_per_token=args.train_s_per_token,
                  fixed_s=args.fixed_s, warmup=args.warmup)
    sync = simulate("sync", **common)
    asy = simulate("async", oversample=args.oversample, max_staleness=args.staleness, **common)
    out = {"bench": "asyncsim", "model_not_measurement": True, "decode_json": args.decode_json,
           "oversample": args.oversample, "max_staleness": args.staleness, "lengths": model.describe(),
           "sync": {k: v for k, v in sync.items() if k != "steps"},
           "async": {k: v for k, v in asy.items() if k != "steps"},
           "async_over_sync": asy["tokens_per_s"] / sync["tokens_per_s"],
           "async_steps": [{k: r[k] for k in ("decode_steps", "rollout_s", "trained_tokens", "carried", "dropped")}
                           for r in asy["steps"]]}
    print(f"[bench.asyncsim] oversample {args.oversample}, staleness {args.staleness}: async / sync "
          f"{out['async_over_sync']:.2f}x (rollout {asy['rollout_s_mean']:.1f} s against {sync['rollout_s_mean']:.1f} s "
          f"per step; a model, not a measurement)", file=sys.stderr, flush=True)
    print(json.dumps(out) if args.json else json.dumps(out, indent=1), flush=True)
    return 0


def show_shapes(args: argparse.Namespace, model: LengthModel) -> int:
    """--shapes: each mode's train shapes (no timing: a flat decode curve)."""
    common = dict(steps=args.steps, k=args.prompts, n=args.n, max_tokens=args.max_tokens, prompt_len=args.prompt_len,
                  model=model, table=[(1, 0.0)], prefill_s_per_token=0.0, train_s_per_token=0.0, fixed_s=0.0,
                  warmup=args.warmup)
    out = {"bench": "asyncsim-shapes", "budget": args.shapes, "oversample": args.oversample,
           "max_staleness": args.staleness, "lengths": model.describe(),
           "sync": train_shapes(simulate("sync", **common)["steps"], args.shapes),
           "async": train_shapes(simulate("async", oversample=args.oversample, max_staleness=args.staleness,
                                          **common)["steps"], args.shapes)}
    for mode in ("sync", "async"):
        t = out[mode]
        print(f"[bench.asyncsim] {mode}: {t['tokens_mean']:.0f} trained tokens per step (sd {t['tokens_sd']:.0f}), "
              f"{t['micro_batches_mean']:.2f} micro-batches of at most {args.shapes} tokens {t['micro_batches']}, "
              f"attention {t['attention_per_token']:.0f} per token", file=sys.stderr, flush=True)
    print(json.dumps(out) if args.json else json.dumps(out, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
