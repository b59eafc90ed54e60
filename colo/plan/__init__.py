"""Whether a job fits, computed from the validated config: the memory plan per GPU and phase (memory.py),
the search for settings that fit (fitting.py), and the plan of a configured job with its refusal (job.py)."""
