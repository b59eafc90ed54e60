"""Weight sync: FSDP2 shards -> colocated vLLM engine through packed, reusable buffers, verified.

    trainer rank r (colo.sync.sender.push_weights)                   vLLM worker (colo.rollout.extension)
    ─────────────────────────────────────────────                    ────────────────────────────────────
    FSDP unit ──unshard() (1 all-gather/unit)──┐
    experts unit ──to_local() (no all-gather    │
      when shard == engine's experts)───────────┤
                                               ▼
    SyncPlan (mapping.py: HF→vLLM names,   pieces ──copy+cast──▶ buffer k%B ──handle (shm / CUDA IPC,
      q|k|v→qkv, experts→w13/w2 rows;                          (transport.py,     opened once, cached)──┐
      plan.py: 256-B aligned offsets)                            allocated once)                          ▼
                                          engine.load_bucket(k%B, pieces) ──Ray──▶ collective_rpc ──▶ copy into
                                            (B loads in flight)                   param.data / staging (CPU)
                                          engine.end_sync(digest) ───────────────▶ re-pack for CPU kernels,
                                            verify.py: coverage + digests  ◀─────── coverage/digest report

Modules: transport (buffers, handles), mapping (names/layouts per architecture), plan (buckets),
source (tensors out of FSDP2), sender (drives a sync), verify (coverage, digests), baseline (the
straightforward path: full_tensor per param, per-expert load_weights; yardstick and reference mode).
"""
