"""The side-by-side's rows for docs/benchmarks.md, from the summary.json files run_colo.py and run_verl.py wrote.

    python tools/peers/verl/table.py /work/.device/.../colo-16x8 /work/.device/.../verl-16x8 [more dirs ...]

One row per run (figure, command, card, date, commit: the commit is this checkout's HEAD, where the table is made),
then, per shape that has both systems, the ratios colo over verl (tokens/s/GPU) and verl over colo (seconds). The
figures are the medians over each run's measured steps; memory is the device's peak in the phase over those steps.
colo's "weight window" is its sync + offload + wake, the span that verl's update_weights covers (vLLM's weights woken,
the full tensors sent over CUDA IPC, the trainer offloaded, the KV cache woken); colo's sync alone is beside it.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def fmt(x, digits: int = 2, unit: str = "") -> str:
    if x is None:
        return "—"
    return f"{x:,.0f}{unit}" if abs(x) >= 100 else f"{x:.{digits}f}{unit}"


def row(s: dict, commit: str) -> str:
    colo = s["system"].startswith("colo")
    ph = s.get("phases_s", {})
    mem = s.get("memory_peak_gib", {})
    if colo:
        phases = (f"rollout {fmt(ph.get('rollout'))} + sleep {fmt(ph.get('sleep'))}, train {fmt(ph.get('train'))}, "
                  f"weights {fmt(s.get('weight_window_s'))} (sync {fmt(s.get('sync_s'))}"
                  f"{', verified' if s.get('sync_verified') else ''})")
        memory = (f"rollout {fmt(mem.get('rollout'))}, train {fmt(mem.get('train'))}, sync {fmt(mem.get('sync'))}, "
                  f"wake {fmt(mem.get('wake'))}")
    else:
        train = sum(ph.get(k) or 0.0 for k in ("reward", "old_log_prob", "adv", "update_actor"))
        phases = (f"gen {fmt(ph.get('gen'))}, train {fmt(train)} (old log-probs {fmt(ph.get('old_log_prob'))}, "
                  f"update {fmt(ph.get('update_actor'))}), weights {fmt(s.get('sync_s'))}")
        memory = (f"gen {fmt(mem.get('gen'))}, train {fmt(mem.get('update_actor'))}, "
                  f"weights {fmt(mem.get('update_weights'))}")
    shape = s.get("shape") or "?"
    steps = f"{s.get('steps_measured')} of {s.get('steps_done')} steps"
    return (f"| {s['system']} | {shape} | **{fmt(s.get('tokens_per_s_per_gpu'), 0)}** | {fmt(s.get('step_s'))} s | "
            f"{phases} | {memory} | {steps} | {s.get('card') or '?'} | {s.get('date')} | {commit} | "
            f"`{s.get('command')}` |")


def main(argv: list[str] | None = None) -> int:
    dirs = [Path(d) for d in (sys.argv[1:] if argv is None else argv)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "?"
    runs = []
    for d in dirs:
        s = json.loads((d / "summary.json").read_text())
        if "shape" not in s:  # colo's summary: the shape from its command
            c = s.get("command", "").split()
            get = lambda flag: c[c.index(flag) + 1] if flag in c else "?"  # noqa: E731
            s["shape"] = f"{get('--prompts')}x{get('--n')}"
        runs.append(s)
    print("| system | prompts x n | tokens/s/GPU | step | phases, s (medians) | peak GPU memory per phase, GiB | "
          "measured | card | date | commit | command |")
    print("| --- | --- | ---: | ---: | --- | --- | --- | --- | --- | --- | --- |")
    for s in runs:
        print(row(s, commit))
    for shape in dict.fromkeys(s["shape"] for s in runs):
        pair = {("colo" if s["system"].startswith("colo") else "verl"): s for s in runs if s["shape"] == shape}
        if len(pair) == 2 and all(p.get("tokens_per_s_per_gpu") for p in pair.values()):
            c, v = pair["colo"], pair["verl"]
            sync = (v["sync_s"] / c["weight_window_s"]) if c.get("weight_window_s") and v.get("sync_s") else None
            ratio = c["tokens_per_s_per_gpu"] / v["tokens_per_s_per_gpu"]
            print(f"\n{shape}: colo / verl tokens/s/GPU = {ratio:.2f}x; "
                  f"weight window verl / colo = {fmt(sync)}x; same tokens per step: "
                  f"{c.get('tokens_per_step') == v.get('tokens_per_step')} ({fmt(c.get('tokens_per_step'), 0)} / "
                  f"{fmt(v.get('tokens_per_step'), 0)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
