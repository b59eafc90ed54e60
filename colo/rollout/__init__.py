"""vLLM side of colo: the RolloutEngine actor (engine.py) and the sync receiver (extension.py)."""
