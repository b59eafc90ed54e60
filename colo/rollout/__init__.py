"""vLLM side of colo and the driver's rollouts: the RolloutEngine actor (engine.py) and the one generation loop it runs
(engine_loop.py) over typed samples (sample.py), with conversations' environments (turns.py); the request an engine
takes and how prompts spread over the engines (generation.py); the worker extension vLLM mixes into each of its
workers (extension.py: the weight sync's receiver, colo.sync.receiver, plus the routing capture, capture.py); the
rollout schedules of the loop (schedule.py) with the async step's carried samples (buffer.py) and the batch generated
ahead (ahead.py); and the vLLM version checks (vllm_compat.py)."""
