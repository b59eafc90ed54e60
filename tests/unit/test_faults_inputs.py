"""Bad checkpoints and data, refused before anything starts (issue 49, section 3): weights that disagree with
config.json (from the safetensors headers), a checkpoint without a tokenizer, an empty data file, a prompt column
that is not text, a folder of mixed files; and the first turn an environment sends, counted at launch. Each is
one ConfigError line with a fix. No Ray, no vLLM."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from colo.config import ConfigError, load_config, resolve_paths, validate
from colo.config.weights import check_model_readable


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from colo.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", "tiny")  # 8 experts, Hub layout


def copy_of(tiny: Path, tmp_path: Path, **config) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(tiny, out)
    data = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**data, **config}))
    return out


def refusal(fn, *args, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        fn(*args, **kw)
    msg = str(e.value)
    assert "\n" not in msg and "fix:" in msg, msg
    return msg


def test_experts_that_config_json_does_not_have_are_refused(tiny: Path, tmp_path: Path) -> None:
    """4 experts in config.json, 8 in the files (and the other way round): named in the config's terms."""
    check_model_readable(str(tiny))  # the checkpoint as written passes
    msg = refusal(check_model_readable, str(copy_of(tiny, tmp_path, num_experts=4, num_local_experts=4)))
    assert "its weights do not match its config.json" in msg, msg
    assert "config.json has 4 experts per MoE layer, the files hold 8 (experts 0-7)" in msg, msg
    assert "mlp.gate.weight is [8, 128] in the files, [4, 128] for config.json" in msg, msg
    more = tmp_path / "more"
    more.mkdir()
    msg = refusal(check_model_readable, str(copy_of(tiny, more, num_experts=16, num_local_experts=16)))
    assert "config.json has 16 experts per MoE layer, the files hold 8" in msg and "missing (first: " in msg, msg


def test_a_q_proj_of_another_shape_is_refused(tiny: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    ckpt = copy_of(tiny, tmp_path)
    [f] = ckpt.glob("*.safetensors")
    tensors = load_file(f)
    name = "model.layers.1.self_attn.q_proj.weight"
    tensors[name] = tensors[name][:-64].clone()  # one head short
    save_file(tensors, f, metadata={"format": "pt"})
    msg = refusal(check_model_readable, str(ckpt))
    assert f"1 tensor(s) of another shape (first: {name} is [192, 128] in the files, [256, 128] for config.json)" in msg
    check_model_readable(str(ckpt), weights=False)  # model.dummy_weights: the files are not read


def test_a_checkpoint_without_a_tokenizer_is_refused(tiny: Path, tmp_path: Path) -> None:
    """Without its files transformers builds an empty tokenizer (every prompt: 0 tokens, and the run died 36 s in
    with "sample 0: empty prompt"): refused by validate(), so --dry-run says it too."""
    ckpt = copy_of(tiny, tmp_path)
    (ckpt / "tokenizer.json").unlink()
    cfg = load_config(None, ["placement.device=cpu", "placement.num_gpus=1", f"model.path={ckpt}"], {})
    msg = refusal(validate, cfg)
    assert f"model.path={ckpt} has no tokenizer" in msg and "save_pretrained" in msg, msg
    assert "has no tokenizer" in refusal(check_model_readable, str(ckpt))


def test_a_max_model_len_past_the_context_is_refused(tiny: Path, tmp_path: Path, monkeypatch) -> None:
    """vLLM refused it inside every engine after Ray started ("engine DP rank 0 died", 24 s in): validate() names
    the key and the length that fits. RoPE scaling lengthens the context as vLLM counts it (linear: times its factor;
    YaRN's max_position_embeddings is already scaled), a tokenizer's model_max_length shortens it, and vLLM's own
    override is honoured."""
    from colo.config.weights import model_context

    def validate_at(ckpt: Path, length: int) -> None:
        validate(load_config(None, ["placement.device=cpu", "placement.num_gpus=1", f"model.path={ckpt}",
                                    f"rollout.max_model_len={length}", "rollout.max_tokens=64"], {}))

    validate_at(tiny, 2048)  # the presets' context: rollout.max_model_len's default fits
    ckpt = copy_of(tiny, tmp_path, max_position_embeddings=1024)
    validate_at(ckpt, 1024)
    msg = refusal(validate_at, ckpt, 2048)
    assert "rollout.max_model_len=2048 is longer than the model's context (max_position_embeddings: 1024" in msg, msg
    assert "fix: rollout.max_model_len=1024" in msg, msg
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    validate_at(ckpt, 2048)
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN")
    base = {"max_position_embeddings": 1024}
    assert model_context({**base, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}) == (
        4096.0, "max_position_embeddings x RoPE factor 4")
    assert model_context({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})[0] == 1024.0
    assert model_context({**base, "seq_length": 512})[0] == 512.0
    assert model_context({"text_config": base})[0] == 1024.0
    assert model_context(base, {"model_max_length": 256}) == (256.0, "model_max_length in tokenizer_config.json")
    assert model_context({**base, "model_max_length": 4096}) is None  # vLLM lets a user go past the key up to it
    assert model_context({"hidden_size": 8}) is None


def data_error(path: Path, *extra: str) -> str:
    return refusal(validate, load_config(None, ["placement.device=cpu", f"data.path={path}", *extra], {}),
                   check_resources=True, check_gpus=False)


def test_an_empty_data_file_says_so(tmp_path: Path) -> None:
    """It was "the first row has no field 'prompt'; fix: data.prompt_key=", which is wrong."""
    empty, blank = tmp_path / "empty.jsonl", tmp_path / "blank.jsonl"
    empty.write_text("")
    blank.write_text("\n  \n")
    assert data_error(empty).startswith(f"data.path={empty} is empty: 0 bytes, no rows; fix: ")
    assert data_error(blank).startswith(f"data.path={blank} is empty: only blank lines, no rows; fix: ")
    import pyarrow as pa
    import pyarrow.parquet as pq

    none = tmp_path / "none.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), none)
    assert data_error(none).startswith(f"data.path={none} is empty: a Parquet file of 0 rows, no rows; fix: ")


def test_a_prompt_column_that_is_not_text_is_refused(tmp_path: Path) -> None:
    """A Parquet column of integers was taken silently: the run trained on prompts like "1000"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ints = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"prompt": [1000, 1001], "answer": ["a", "b"]}), ints)
    msg = data_error(ints)
    assert "the prompt column 'prompt' holds int64 values, not text" in msg and ".astype(str)" in msg, msg
    jsonl = tmp_path / "ints.jsonl"
    jsonl.write_text('{"prompt": "fine", "answer": "1"}\n{"prompt": 7, "answer": "2"}\n')
    from colo.data.prompts import read_rows

    with pytest.raises(ValueError, match=r"row 1 \(line 2\): field 'prompt' is int 7, not text or chat messages; fix: "):
        read_rows(jsonl, ["prompt", "answer"], text=["prompt"])
    first = tmp_path / "first.jsonl"
    first.write_text('{"prompt": 7, "answer": "2"}\n')
    assert "holds an int in its first row, not text" in data_error(first)


def test_a_folder_of_mixed_files_gets_a_fix(tmp_path: Path) -> None:
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"prompt": "p", "answer": "a"}\n')
    (folder / "b.parquet").write_bytes(b"PAR1")
    (folder / "notes.txt").write_text("x")
    msg = data_error(folder)
    assert "not a dataset written by datasets' save_to_disk" in msg and "it holds a.jsonl, b.parquet, notes.txt" in msg
    assert f"fix: point data.path at one file (e.g. data.path={folder / 'a.jsonl'}), or join them into one" in msg
    hub = tmp_path / "gsm8k"  # as huggingface-cli download --repo-type dataset lays it out: said "it is empty"
    (hub / "main").mkdir(parents=True)
    (hub / "README.md").write_text("# card")
    for split in ("test", "train"):
        (hub / "main" / f"{split}-00000-of-00001.parquet").write_bytes(b"PAR1")
    msg = data_error(hub)
    assert "it holds README.md, main/test-00000-of-00001.parquet, main/train-00000-of-00001.parquet" in msg, msg
    assert f"(e.g. data.path={hub / 'main' / 'test-00000-of-00001.parquet'})" in msg, msg


def test_the_length_check_counts_the_environments_first_turn(tmp_path: Path) -> None:
    """algo.environment=python with configs/tiny-cpu-tools.yaml died at the first rollout with vLLM's "maximum
    context length is 128 tokens ... 155 input tokens": reset()'s system message was not counted. Now the launch
    refuses it before the run dir exists, in the environment's own process; with room for it, it passes."""
    from colo.materialize import check_user_data

    root = Path(__file__).resolve().parents[2]
    base = [f"run.dir={tmp_path / 'run'}", "algo.environment=python"]
    cfg = load_config(str(root / "configs" / "tiny-cpu-tools.yaml"), base, {})
    msg = refusal(check_user_data, cfg, resolve_paths(cfg))
    assert msg.startswith("data: auto:calc: row 0: its first turn (the environment's reset() messages) is 156 tokens, "
                          "longer than rollout.max_model_len=128; 2000 of 2000 rows are too long"), msg
    assert "fix: rollout.max_model_len=220" in msg and not (tmp_path / "run").exists()
    cfg = load_config(str(root / "configs" / "tiny-cpu-tools.yaml"), [*base, "rollout.max_model_len=220"], {})
    check_user_data(cfg, resolve_paths(cfg))
