"""The weight path: FSDP2 shards on trainer rank r -> vLLM's parameters, verified. Read in this order:

    sender.py  (trainer)                    transport.py                      receiver.py  (vLLM worker)
    ────────────────────                    ────────────                      ──────────────────────────
    Sender: FSDP unit ──unshard() (1 all-gather/unit;
      experts ──to_local(): none when the shard is the
      engine's experts)──▶ pack_piece: copy+cast ──▶ buffer k % B ──handle: shm / CUDA IPC (colocated),
                                                      (SenderBuffers,    opened once, cached)──────────┐
                                                       allocated once)  broadcast (disaggregated,      │
                                                                         WeightGroup)                  ▼
    link.send(k) ──engine.load_bucket (Ray)──▶ collective_rpc ──────────────▶ colo_load_bucket: copy into
                                                                                each param's checkpoint layout
                                                                                (the live param, or staging)
    end_sync on every engine ◀── coverage + checksums report ◀─────────────── colo_end_sync: verify, then
                                                                                vLLM's post-load step again
                                                                                (refresh.py)
    then (loop): the engines and the trainer score the same sequences ─── probe.py: the functional check

Data beside them: plan.py (the SyncPlan: the HF -> vLLM name rules applied to the family's table from
colo.models.archs, and which element runs go into which bucket at which offset, built once), verify.py (coverage),
checksum.py (the exact checksum of every tensor's bytes, taken in the sender's and the receiver's copies; on CUDA
checksum_cuda.py's kernel does copy and checksum in one pass),
refresh.py (what vLLM derives from the weights, made again from the new bytes), probe.py (whether the engine computes what the trainer computes), fp8.py (FP8 rollout: the sender's
block quantization and the scales the plan carries beside each quantized tensor). The yardsticks the benchmark
compares with live in colo.bench.yardsticks, not here.
"""
