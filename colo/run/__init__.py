"""What a run leaves behind: metrics.jsonl, TensorBoard, W&B and the plot (metrics.py), the end-of-run
summary (summary.py), and where the actors' output goes (logs.py)."""
