"""RL algorithm pieces: advantages, policy loss, rewards, prompt data and synthetic tasks."""
