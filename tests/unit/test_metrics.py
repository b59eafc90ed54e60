import json
import math

import torch

from colo.run.metrics import MetricsWriter, ProgressLine, format_progress, plot_metrics, read_metrics, timing_layout


def _step(i):
    return {"reward/mean": 0.1 * i, "loss": torch.tensor(1.0 / (i + 1)), "sync/verified": True,
            "timing/rollout_s": 1.0, "timing/train_s": 0.5 + i, "timing/sync_s": 0.2,
            "timing/step_s": 1.7 + i, "grad_norm": float("nan")}


def _tb_tags(tb_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return acc


def test_writer_jsonl_tensorboard_png(tmp_path):
    with MetricsWriter(tmp_path) as w:
        for i in range(3):
            rec = w.log(i, _step(i))
    assert abs(rec["loss"] - 1.0 / 3) < 1e-7 and rec["grad_norm"] is None
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    rows = [json.loads(ln) for ln in lines]  # strict JSON: NaN became null
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[1]["reward/mean"] == 0.1
    assert rows[0]["sync/verified"] is True
    acc = _tb_tags(tmp_path / "tb")
    assert {"reward/mean", "loss", "timing/train_s", "sync/verified"} <= set(acc.Tags()["scalars"])
    assert "grad_norm" not in acc.Tags()["scalars"]  # null (was nan) is not a scalar
    assert [e.step for e in acc.Scalars("reward/mean")] == [0, 1, 2]
    png = (tmp_path / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_resume_drops_later_steps_and_plot_spans_whole_run(tmp_path):
    w = MetricsWriter(tmp_path)
    w.log(-1, {"sft/loss_last": 1.5, "eval/reward": 0.2})  # the loop's warm-up record
    for i in range(4):
        w.log(i, {**_step(i), **({"eval/reward/mean": 0.5 + i / 10} if i % 2 else {})})
    w.close()
    # interrupted after step 3, but the checkpoint is at step 1: steps 2 and 3 are logged again
    for how in ("constructor", "method"):
        if how == "constructor":
            w = MetricsWriter(tmp_path, resume_step=1)
        else:
            w = MetricsWriter(tmp_path)
            w.resume_from(1)
        w.log(2, {"reward/mean": 9.0})
        assert w.close() == tmp_path / "metrics.png"
        rows = read_metrics(tmp_path / "metrics.jsonl")
        assert [r["step"] for r in rows] == [-1, 0, 1, 2] and rows[3]["reward/mean"] == 9.0
        assert math.isclose(rows[2]["eval/reward/mean"], 0.6)
    # TensorBoard purged the stale steps 2 and 3 of the first run: one value per step remains
    scalars = _tb_tags(tmp_path / "tb").Scalars("reward/mean")
    assert [(e.step, e.value) for e in scalars][-1] == (2, 9.0)
    assert [e.step for e in scalars] == [0, 1, 2]


def test_progress_line(capsys):
    m = {"step": 3, "reward/mean": 0.41234, "timing/step_s": 12.345, "timing/sync_s": 0.5,
         "eval/reward/mean": 0.7}
    assert format_progress(m) == {"reward": "0.412", "eval": "0.700", "step_s": "12.3",
                                  "sync_s": "0.50"}
    p = ProgressLine(total_steps=5)
    p.update(m)
    line = p.update({"reward/mean": 0.5})  # no eval this step: the last one stays on screen
    p.close()
    assert line == "reward=0.500, eval=0.700"
    assert "reward=0.500" in capsys.readouterr().err


def test_phase_panel_draws_parts_inside_their_phase_and_new_phases_without_a_change(tmp_path, monkeypatch):
    """timing/batch_s is a part of timing/train_s and timing/batch_cpu_s a CPU time: stacked on the phases, their
    bars overshot the step's total. A phase key the plot has never seen (timing/shiny_s) is stacked as it is."""
    keys = {"timing/rollout_s", "timing/train_s", "timing/batch_s", "timing/batch_cpu_s", "timing/sync_s",
            "timing/offload_s", "timing/wake_s", "timing/step_s", "timing/shiny_s", "reward/mean"}
    phases, parts = timing_layout(keys)
    assert phases == ["timing/rollout_s", "timing/train_s", "timing/sync_s", "timing/offload_s", "timing/wake_s",
                      "timing/shiny_s"]  # colo.loop.rl_step's order, then what the plot has never seen
    assert parts == {"timing/batch_s": "timing/train_s"}
    assert timing_layout({"timing/batch_s", "timing/rollout_s"}) == (["timing/rollout_s"], {})  # no phase: no part

    import matplotlib.axes

    drawn = []  # every bar call of the phase panel: (label, tops)
    bar = matplotlib.axes.Axes.bar

    def spy(ax, x, height, *args, bottom=0.0, label=None, **kw):
        base = bottom if isinstance(bottom, list) else [bottom] * len(x)
        drawn.append((label, [b + h for b, h in zip(base, height)]))
        return bar(ax, x, height, *args, bottom=bottom, label=label, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", spy)
    rows = [{"step": s, "timing/rollout_s": 1.0, "timing/train_s": 2.0, "timing/batch_s": 1.5,
             "timing/batch_cpu_s": 1.4, "timing/sync_s": 0.5, "timing/offload_s": 0.2, "timing/step_s": 3.8,
             "reward/mean": 0.1 * s} for s in range(12)]
    plot_metrics(rows, tmp_path / "m.png")
    assert [label for label, _ in drawn] == ["rollout", "train", "sync", "offload", "batch (part of train)"]
    assert max(max(tops) for _, tops in drawn) <= 3.8, drawn  # nothing above the step's total
    assert drawn[-1][1] == [2.5] * 12  # the part: from the train bar's base (1.0) up 1.5, inside train (1.0-3.0)


def test_warm_up_bar_shows_its_loss(capsys):
    p = ProgressLine(total_steps=3, desc="warm-up")
    assert p.update({"sft_loss": 1.23456}) == "sft_loss=1.235"
    p.close()
    assert "warm-up:" in capsys.readouterr().err


def _wandb_records(path):
    """Decode a W&B transaction log (<run>/run-<id>.wandb): a ':W&B' header, then LevelDB-log records
    (crc32, uint16 length, type: 1 full / 2 first / 3 middle / 4 last) in 32 KiB blocks, each a protobuf
    Record. W&B 0.31 ships no reader for it, so the test carries this one."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, pending, out = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is zero padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            out.append(rec)
    return out


def test_wandb_offline_logs_the_same_scalars_and_the_config(tmp_path):
    from colo.run.metrics import WandbSettings

    settings = WandbSettings(project="colo-test", mode="offline", config={"trainer": {"lr": 4e-4}})
    with MetricsWriter(tmp_path, loggers=["jsonl", "wandb"], wandb=settings) as w:
        w.log(-1, {"sft/loss_last": 1.5})
        for i in range(2):
            w.log(i, _step(i))
    run_id = (tmp_path / "wandb_id").read_text().strip()
    (log,) = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    recs = _wandb_records(log)
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in recs if r.WhichOneof("record_type") == "history"]
    assert [h["step"] for h in history] == [-1, 0, 1]  # colo's step, the warm-up included
    assert history[2]["reward/mean"] == 0.1 and history[2]["timing/train_s"] == 1.5
    assert history[2]["sync/verified"] == 1.0 and "grad_norm" not in history[2]  # nan is not logged
    (run,) = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["trainer"] == {"lr": 4e-4}
    assert not (tmp_path / "tb").exists()  # tensorboard was not asked for
