"""RL algorithm pieces: advantages, batches, policy loss, rewards, the trainer-vs-engine gap, routing replay."""
