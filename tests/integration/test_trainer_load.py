"""colo.trainer.load: each rank reads its own rows of a multi-file checkpoint, bit-identical to the rank-0 path.

Real FSDP2 over gloo in 2 spawned processes (tools.experiments.loadmem's worker): per rank, a model loaded the old
way (rank 0 from_pretrained fp32 + set_model_state_dict broadcast) and one loaded by load_sharded must hold
the same bytes in every local shard. The checkpoint has an uneven expert split (5 experts on 2 ranks),
an odd vocabulary (uneven dim-0 shards) and is cut into several safetensors files.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tools.experiments.loadmem import run_ranks, write_checkpoint

UNEVEN = {"num_experts": 5, "vocab_size": 515}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("ckpt"))
    return write_checkpoint(out, "tiny", layers=2, shard_size="300KB", overrides=UNEVEN)


def test_checkpoint_is_hub_layout_in_several_files(ckpt: str) -> None:
    from colo.trainer.load import read_index

    index = read_index(ckpt)
    assert len({e.file for e in index.values()}) >= 3
    assert "model.layers.1.mlp.experts.4.up_proj.weight" in index  # per-expert names, as on the Hub
    assert not any(k.endswith("gate_up_proj") for k in index)


def test_direct_load_is_bit_identical_to_rank0_broadcast(ckpt: str) -> None:
    reports = run_ranks(ckpt, ["rank0", "direct"], ranks=2)
    for rep in reports:
        old, new = rep["rank0"]["digests"], rep["direct"]["digests"]
        assert old.keys() == new.keys() and len(old) > 20
        assert old == new, [n for n in old if old[n] != new[n]]
    # the ranks hold different rows (a loader that gave every rank rank 0's rows would still agree above)
    assert reports[0]["direct"]["digests"] != reports[1]["direct"]["digests"]


def test_single_process_matches_from_pretrained_and_refuses_missing(ckpt: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from colo.trainer.fsdp import meta_model
    from colo.trainer.load import load_sharded

    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).state_dict()
    model = meta_model(ckpt)
    model.to_empty(device="cpu")
    load_sharded(model, ckpt)
    for name, p in model.named_parameters():
        assert torch.equal(p, ref[name]), name
    broken = tmp_path / "broken"
    broken.mkdir()
    files = sorted(Path(ckpt).glob("*"))
    for f in files:
        if f.name != sorted(x.name for x in files if x.suffix == ".safetensors")[1]:
            (broken / f.name).write_bytes(f.read_bytes())
    model = meta_model(str(broken))
    model.to_empty(device="cpu")
    with pytest.raises(ValueError, match="missing"):
        load_sharded(model, str(broken))
