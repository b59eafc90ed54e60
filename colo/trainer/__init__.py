"""The FSDP2 side of colo: build and shard the policy (fsdp; compile: its layers under torch.compile), load each
rank's own rows from safetensors (load), train it (worker; attention: packed rows; optim: the AdamW variants),
park its state in host memory between phases (offload), and save, resume and export it (checkpoint).

Import `colo.trainer.worker.TrainWorker` for the Ray actor; this package imports nothing heavy.
"""
