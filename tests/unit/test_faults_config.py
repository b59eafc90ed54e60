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
