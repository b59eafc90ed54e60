"""The FSDP2 side of colo: build and shard the policy (fsdp), train it (worker), park its state in
host memory between phases (offload), and save, resume and export it (checkpoint).

Import `colo.trainer.worker.TrainWorker` for the Ray actor; this package imports nothing heavy.
"""
