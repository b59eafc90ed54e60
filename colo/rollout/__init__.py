"""vLLM side of colo: the RolloutEngine actor (engine.py) and the vLLM version checks (vllm_compat.py); the
weight sync's receiver, which vLLM mixes into its worker, is colo.sync.receiver."""
