"""Whether a job fits, and the fastest settings that do, computed from the validated config: the job as the plan
reads it (settings.py), the memory plan per GPU and phase (memory.py), a step's train work per setting from measured
figures (cost.py), the `auto` trainer settings resolved to the fastest that fits (auto.py), the search for settings
that fit a refused job (fitting.py), and the plan of a configured job with its refusal (job.py)."""
