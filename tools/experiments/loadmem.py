"""Loading a checkpoint into FSDP2 shards: colo's per-rank reader against the rank-0 path, in one run.

    python -m tools.experiments.loadmem --preset qwen3-30b-a3b --layers 1 --ranks 2 --shard-size 1GB [--json]

Writes a Hub-layout checkpoint (the preset's config with `--layers` decoder layers, random bf16 weights,
save_pretrained with max_shard_size, so several safetensors files and per-expert tensor names), then
loads it into a meta-built, FSDP2-sharded model on `--ranks` CPU processes over gloo, twice, each path
in fresh processes:

- **rank0** (colo's loader before colo.trainer.load, kept here as the yardstick): rank 0 builds the whole
  model in fp32 with `from_pretrained`, `set_model_state_dict(broadcast_from_rank0=True)` sends it
  tensor by tensor and every rank keeps its dim-0 shard.
- **direct** (`colo.trainer.load.load_sharded`): every rank preads its own rows and experts.

Reported per rank: peak RSS of the process (`ru_maxrss`: imports, the shard and whatever the path needs),
RSS before loading, load seconds, and a digest of every local shard; the paths must agree bit for bit
(`identical`). The ratio is rank 0's peak RSS of rank0 over direct.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from colo.host.net import free_port


def write_checkpoint(out: str, preset: str, layers: int, shard_size: str, seed: int = 0,
                     overrides: dict[str, Any] | None = None) -> str:
    """A random bf16 checkpoint in the Hub's layout (per-expert tensors), split by max_shard_size."""
    from transformers import AutoModelForCausalLM

    from colo.models.tiny import preset_config

    cfg = preset_config(preset)
    cfg.num_hidden_layers = cfg.max_window_layers = layers
    for k, v in (overrides or {}).items():
        setattr(cfg, k, v)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # (...) bf16; values matter only for the comparison
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(0.02).to(p.dtype))
    model.save_pretrained(out, max_shard_size=shard_size)
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _worker(rank: int, world: int, port: int, model_dir: str, paths: list[str], out_dir: str) -> None:
    """One rank: for each path, a fresh sharded model loaded that way; writes <out_dir>/rank<r>.json."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from colo.trainer.fsdp import meta_model, parallelize, rebuild_buffers
    from colo.trainer.load import load_sharded

    mesh = init_device_mesh("cpu", (world,))
    report: dict[str, Any] = {"rank": rank}
    for path in paths:
        model = parallelize(meta_model(model_dir), mesh)
        model.to_empty(device="cpu")
        dist.barrier()
        before, t0 = _rss(), time.perf_counter()
        if path == "rank0":
            full = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict() \
                if rank == 0 else {}
            set_model_state_dict(model, full, options=StateDictOptions(
                full_state_dict=True, broadcast_from_rank0=True, strict=True))
            del full
        else:
            load_sharded(model, model_dir)
        rebuild_buffers(model)
        seconds = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # before the digests touch anything
        dist.barrier()
        # hashed in place (the buffer protocol of the numpy view): no copy inflates a later path's peak
        digests = {n: hashlib.blake2b(p.to_local().detach().contiguous().numpy(), digest_size=16).hexdigest()
                   for n, p in model.named_parameters()}
        report[path] = {"seconds": seconds, "rss_before": before, "rss_after": _rss(), "peak_rss": peak,
                        "digests": digests}
        del model
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def run_ranks(model_dir: str, paths: list[str], ranks: int) -> list[dict[str, Any]]:
    """`ranks` fresh processes (spawn) load the checkpoint by each path in turn; their reports, rank order."""
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(ranks, port, model_dir, paths, out), nprocs=ranks, start_method="spawn")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(ranks)]


def compare(model_dir: str, ranks: int) -> dict[str, Any]:
    """Each path in processes of its own (peak RSS is per process lifetime)."""
    old, new = run_ranks(model_dir, ["rank0"], ranks), run_ranks(model_dir, ["direct"], ranks)
    G = 2**30
    per_rank = [{"rank": r, **{f"{k}_{p}": round(rep[p][k] / G, 3) for p, rep in (("rank0", o), ("direct", n))
                                for k in ("peak_rss", "rss_before", "rss_after")},
                 "seconds_rank0": round(o["rank0"]["seconds"], 3), "seconds_direct": round(n["direct"]["seconds"], 3)}
                for r, (o, n) in enumerate(zip(old, new))]
    identical = all(o["rank0"]["digests"] == n["direct"]["digests"] for o, n in zip(old, new))
    return {"ranks": per_rank, "identical": identical,
            "peak_rss_ratio_rank0": round(old[0]["rank0"]["peak_rss"] / new[0]["direct"]["peak_rss"], 2),
            "seconds_ratio": round(max(o["rank0"]["seconds"] for o in old) / max(n["direct"]["seconds"] for n in new), 2)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--shard-size", default="1GB", help="save_pretrained max_shard_size (several files)")
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp dir, removed)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    tmp = None if args.dir else tempfile.TemporaryDirectory(prefix="colo-bench-load-")
    model_dir = args.dir or tmp.name  # type: ignore[union-attr]
    try:
        t0 = time.perf_counter()
        ctx = mp.get_context("spawn")  # written in a child: the parent stays small while the ranks run
        p = ctx.Process(target=write_checkpoint, args=(model_dir, args.preset, args.layers, args.shard_size))
        p.start()
        p.join()
        if p.exitcode:
            sys.exit(f"writing the checkpoint failed (exit {p.exitcode})")
        files = sorted(x.name for x in Path(model_dir).glob("*.safetensors"))
        size = sum(x.stat().st_size for x in Path(model_dir).glob("*.safetensors"))
        out = {"preset": args.preset, "layers": args.layers, "files": len(files), "checkpoint_gb": round(size / 1e9, 3),
               "write_seconds": round(time.perf_counter() - t0, 1), **compare(model_dir, args.ranks),
               "torch": torch.__version__}
    finally:
        if tmp is not None:
            tmp.cleanup()
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['preset']} L{out['layers']}: {out['checkpoint_gb']} GB in {out['files']} files, {args.ranks} ranks; "
          f"bit-identical: {out['identical']}")
    for r in out["ranks"]:
        print(f"  rank {r['rank']}: peak RSS rank0 path {r['peak_rss_rank0']:.2f} GiB, direct {r['peak_rss_direct']:.2f} GiB;"
              f" load {r['seconds_rank0']:.1f} s vs {r['seconds_direct']:.1f} s")
    print(f"  rank 0 peak RSS ratio (rank0 / direct): {out['peak_rss_ratio_rank0']}x; "
          f"load time ratio {out['seconds_ratio']}x")


if __name__ == "__main__":
    main()
