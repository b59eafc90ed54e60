"""What a run reads: prompt data from files and datasets (prompts.py), the synthetic tasks (tasks.py), and
the driver's tokenizer, prompts and warm-up examples for a run (inputs.py)."""
