"""Where a job runs and its actors: the placement plan and groups (placement.py), the nodes of a Ray
cluster (nodes.py), the trainer and engine actors and the typed group handles the loop calls (actors.py)."""
