"""This machine's resources a process shares with others: named shared memory (shm.py), free ports and
the address gloo and vLLM bind (net.py)."""
