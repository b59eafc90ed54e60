import json
import math

import torch

from colo.metrics import MetricsWriter, ProgressLine, format_progress, read_metrics


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
