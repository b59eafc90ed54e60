"""Faults a user's config or data brings, refused before anything starts: one ConfigError line with the fix."""
from __future__ import annotations

import pytest

from colo.config import ConfigError, load_config, validate


def config_error(overrides: list[str], check_resources: bool = False) -> str:
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, ["placement.device=cpu", *overrides], {}), check_resources=check_resources)
    msg = str(e.value)
    assert "\n" not in msg and "fix:" in msg, msg
    return msg


def test_group_of_one_is_refused() -> None:
    """rollout.n=1: every group-normalized advantage is 0, so nothing would train."""
    msg = config_error(["rollout.n=1"])
    assert "rollout.n=1" in msg and "rollout.n=8" in msg
    validate(load_config(None, ["placement.device=cpu", "rollout.n=2"], {}), check_resources=False)


def test_greedy_sampling_is_refused() -> None:
    """rollout.temperature=0: a group is one greedy answer n times, so every advantage is 0 (a 4-step job ran
    with loss and grad_norm 0 on every step, and said nothing)."""
    msg = config_error(["rollout.temperature=0"])
    assert msg.startswith("rollout.temperature=0 samples") and "fix: rollout.temperature=1.0" in msg, msg
    validate(load_config(None, ["placement.device=cpu", "rollout.temperature=0.6"], {}), check_resources=False)


def test_late_bad_byte_names_file_and_line(tmp_path) -> None:
    """A Latin-1 byte on line 2000 of a JSONL file (past the first decode chunk): the file and the line."""
    from colo.data.prompts import read_rows

    path = tmp_path / "train.jsonl"
    good = b'{"prompt": "1+1=", "answer": "2"}\n'
    path.write_bytes(good * 1999 + b'{"prompt": "caf\xe9", "answer": "2"}\n' + good)
    with pytest.raises(ValueError) as e:
        read_rows(path, ["prompt", "answer"])
    assert str(path) in str(e.value) and "line 2000" in str(e.value) and "fix:" in str(e.value), e.value
    # the config check reads the first row only, and does not trip over the late byte
    validate(load_config(None, ["placement.device=cpu", f"data.path={path}"], {}), check_resources=False)


def test_ray_address_where_nothing_listens() -> None:
    """run.ray_address / RAY_ADDRESS with no cluster behind it: refused at once, naming the address."""
    import socket
    import time

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens on it now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, ["placement.device=cpu"], {"RAY_ADDRESS": f"127.0.0.1:{port}"}))
    assert f"127.0.0.1:{port}" in str(e.value) and "fix:" in str(e.value) and "\n" not in str(e.value)
    assert time.perf_counter() - t0 < 15


def test_truncated_safetensors_refused_naming_the_file(tmp_path) -> None:
    """A checkpoint whose shard was cut short (or whose header is garbage) is refused by validate(), before Ray
    starts, naming the file: the header's data offsets against the file's size."""
    import json

    import torch
    from safetensors.torch import save_file

    from colo.models.tiny import PRESETS

    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny"]))
    (tmp_path / "tokenizer.json").write_text("{}")
    good, bad = tmp_path / "model-00001-of-00002.safetensors", tmp_path / "model-00002-of-00002.safetensors"
    save_file({"a": torch.zeros(64)}, good)
    save_file({"b": torch.zeros(64)}, bad)
    overrides = ["placement.device=cpu", "placement.num_gpus=1", f"model.path={tmp_path}"]
    validate(load_config(None, overrides, {}))  # whole files pass
    data = bad.read_bytes()
    for broken in (data[:-10], b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!", data[:5]):
        bad.write_bytes(broken)
        with pytest.raises(ConfigError) as e:
            validate(load_config(None, overrides, {}))
        assert str(bad) in str(e.value) and "fix:" in str(e.value) and "\n" not in str(e.value), e.value


def test_prompt_too_long_refused_at_data_read(tmp_path) -> None:
    """A prompt longer than rollout.max_model_len, or one that leaves less than rollout.max_tokens for its
    response, is refused when the data is read (before the run dir), with its row, the count and the fix;
    the engine used to refuse it at the first rollout, after the warm-up."""
    import json

    from colo.config import resolve_paths
    from colo.materialize import check_user_data

    data = tmp_path / "train.jsonl"
    rows = [{"prompt": "1+1=", "answer": "2"}] * 3 + [{"prompt": "1+1= " * 200, "answer": "2"}] * 2
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def check(*overrides: str) -> None:
        cfg = load_config(None, ["placement.device=cpu", f"data.path={data}", f"run.dir={tmp_path}/run",
                                 "data.eval_path=null", *overrides], {})
        check_user_data(cfg, resolve_paths(cfg))

    with pytest.raises(ConfigError) as e:
        check("rollout.max_model_len=256", "rollout.max_tokens=32")
    msg = str(e.value)
    assert str(data) in msg and "row 3" in msg and "2 of 5 rows" in msg, msg
    assert "longer than rollout.max_model_len=256" in msg and "fix: rollout.max_model_len=" in msg and "\n" not in msg
    need = int(msg.rsplit("fix: rollout.max_model_len=", 1)[1].split(",")[0])
    with pytest.raises(ConfigError, match="leaves .* for a response of rollout.max_tokens=32"):
        check(f"rollout.max_model_len={need - 1}", "rollout.max_tokens=32")  # the prompt fits, its response not
    check(f"rollout.max_model_len={need}", "rollout.max_tokens=32")  # the fix it names is enough
    assert not (tmp_path / "run").exists()


def yaml_error(tmp_path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(str(path), [], {})
    msg = str(e.value)
    assert "\n" not in msg and "fix:" in msg and str(path) in msg, msg
    return msg


def test_yaml_is_read_strictly(tmp_path) -> None:
    """A key given twice was taken silently (the second won), and a second `loop:` section dropped the first's keys
    back to their defaults; a dotted key got "unknown 'trainer.lr' (did you mean 'trainer.lr'?)"; a missing
    ${...} target was named without the key or the file that refers to it."""
    assert "key 'lr' given twice (line 2 and line 3)" in yaml_error(tmp_path, "trainer:\n  lr: 1.0e-5\n  lr: 2.0e-5\n")
    msg = yaml_error(tmp_path, "loop:\n  steps: 9\ntrainer:\n  lr: 1.0e-5\nloop:\n  eval_every: 3\n")
    assert "section 'loop' given twice (line 1 and line 5)" in msg and "went back to its default" in msg, msg
    path = tmp_path / "dotted.yaml"  # dotted keys are what key=value on the command line takes: accepted here too
    path.write_text("trainer.lr: 3.0e-5\nloop:\n  steps: 7\nloop.eval_every: 2\n")
    cfg = load_config(str(path), [], {})
    assert (cfg.trainer.lr, cfg.loop.steps, cfg.loop.eval_every) == (3e-5, 7, 2)
    assert "'trainer.lr' is set twice (as a dotted key and in a section)" in yaml_error(
        tmp_path, "trainer.lr: 3.0e-5\ntrainer:\n  lr: 1.0e-5\n")
    assert "unknown config key 'trainer.lrate'" in yaml_error(tmp_path, "trainer.lrate: 1.0\n")
    msg = yaml_error(tmp_path, "data:\n  eval_path: ${data.nope}\n")
    assert msg.startswith(f"data.eval_path in config file {tmp_path / 'c.yaml'}: Interpolation key 'data.nope' not "
                          "found; fix:"), msg
