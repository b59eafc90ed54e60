"""Whether a job fits, and the fastest settings that do, computed from the validated config: the job as the plan
reads it (settings.py), the memory plan per GPU and phase (memory.py), a step's train work per setting from each
device's measured speeds (cost.py), one search over settings ranked by that cost, which both the `auto` choice and a
refusal's ways to fit use (search.py), the `auto` trainer settings resolved to the fastest that fits (auto.py),
loop.mode=auto resolved from the measured async rows (loopmode.py), the device a job is planned for and its refusal
(job.py), and every `auto` of a config resolved once (resolve.py)."""
