"""vLLM side of colo and the driver's rollouts: the RolloutEngine actor with its one generation path (engine.py),
the request it takes and how prompts spread over the engines (generation.py), the worker extension vLLM mixes into
each of its workers (extension.py: the weight sync's receiver, colo.sync.receiver, plus the routing capture,
capture.py), multi-turn conversations (multiturn.py), partial rollouts (partial.py), the rollout schedules of the
loop (schedule.py) with the async step's carried samples (buffer.py) and the batch generated ahead (ahead.py), and
the vLLM version checks (vllm_compat.py)."""
