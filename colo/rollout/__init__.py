"""vLLM side of colo: the RolloutEngine actor (engine.py), the worker extension vLLM mixes into each of its
workers (extension.py: the weight sync's receiver, colo.sync.receiver, plus the routing capture, capture.py),
and the vLLM version checks (vllm_compat.py)."""
