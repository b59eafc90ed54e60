"""What colo knows of model families (archs.py: one table per family), dtype names (dtypes.py), and the tiny
checkpoints tests and demos build (tiny.py, families.py, tokenizer.py; written once by build.py)."""
