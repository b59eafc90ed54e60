"""Faults through the real CLI that end before any job starts: one `colo: error:` line, exit 2, nothing written."""
from __future__ import annotations

import socket
from pathlib import Path

from conftest import clean_env, run_cli


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ray_address_unreachable_fails_fast(tmp_path: Path) -> None:
    """RAY_ADDRESS where nothing listens: --dry-run and a run both answer within ~15 s (Ray's own join
    retried for minutes), with the address and the fix, and create no run dir."""
    address = f"127.0.0.1:{closed_port()}"
    for extra in (["--dry-run"], []):
        run_dir = tmp_path / ("dry" if extra else "run")
        r = run_cli(*extra, f"run.dir={run_dir}", env=clean_env(RAY_ADDRESS=address), timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("colo: error:"), r.stderr
        assert address in lines[0] and "fix:" in lines[0]
        assert r.seconds < 15 and not run_dir.exists(), (r.seconds, run_dir)


def test_weights_that_disagree_with_config_json_end_before_ray(tmp_path: Path) -> None:
    """A checkpoint whose config.json says 4 experts and whose files hold 8 failed after the cluster started, as a
    58-line chained traceback with no `colo: error:` line, no error.log, and a run dir left behind. Now: one line
    from the safetensors headers, exit 2, no run dir, no Ray."""
    import json
    import shutil

    from colo.models.tiny import make_tiny_model

    ckpt = tmp_path / "ckpt"
    shutil.copytree(make_tiny_model(tmp_path / "tiny", "tiny"), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "num_experts": 4, "num_local_experts": 4}))
    run_dir = tmp_path / "run"
    r = run_cli(f"model.path={ckpt}", "placement.num_gpus=1", f"run.dir={run_dir}", timeout=300, imports=True)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("colo: error:"), r.stderr
    assert "config.json has 4 experts per MoE layer, the files hold 8" in lines[0] and "fix:" in lines[0]
    assert not run_dir.exists() and "ray" not in r.imported and "vllm" not in r.imported
