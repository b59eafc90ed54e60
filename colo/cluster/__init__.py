"""Where a job runs and its actors: the placement plan and groups (placement.py), the nodes of a Ray
cluster (nodes.py), the trainer and engine actors and the typed group handles the loop calls (actors.py), and
the placement side of a step: what colocated actors sleep, wake and offload around the train phase (sides.py)."""
