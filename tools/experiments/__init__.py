"""Answered experiments: one-off measurements whose answers are in docs/benchmarks.md ("Answered experiments").
How to run one: tools/experiments/README.md."""
