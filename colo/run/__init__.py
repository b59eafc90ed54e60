"""What a run leaves behind: metrics.jsonl, TensorBoard, W&B and the plot (metrics.py), the end-of-run
summary (summary.py), where the actors' output goes (logs.py), the run dir's lock and complete checkpoints
(rundir.py), and Ctrl-C / SIGTERM as a graceful stop (signals.py)."""
