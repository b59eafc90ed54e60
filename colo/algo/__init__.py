"""RL algorithm pieces, pure torch, used by the driver and the trainer: group-relative advantages
(advantages.py), rollout samples to trainer batches and their shards (batch.py), the policy loss (loss.py),
log-probs and entropy through the lm_head by chunks (logprobs.py), micro-batches packed by tokens (packing.py),
rewards (rewards.py, math_reward.py), the trainer-vs-engine log-prob gap (parity.py) and routing replay in the
trainer's MoE routers (replay.py)."""
