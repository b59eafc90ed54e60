"""The job as the memory plan reads it: the config tree itself, concrete, and the numbers derived from it.

    s = Settings.from_config(cfg)                  # cfg resolved: colo.plan.resolve left no `auto` key
    s.trainer.offload, s.placement.num_gpus        # read where the config keeps them: no copy, no defaults here
    s.with_({"trainer.offload": False})            # a change is a dotted config key, as a user types it
    Settings.of({"placement.num_gpus": 1})         # tests, benches: ColoConfig's defaults with these on top

One source of truth: the plan reads the config's own fields (colo.config.schema), so a new config key (LoRA's
rank, say) is a term of the plan without a field here, and ways to fit are reported in the keys they change.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from colo.config.schema import AlgoConfig, ColoConfig, PlacementConfig, RolloutConfig, TrainerConfig

PLAIN: dict[str, Any] = {
    "trainer.offload": True, "trainer.optimizer_offload": False, "trainer.compile": False,
    "trainer.gradient_checkpointing": False, "trainer.gather_once": False,
    "trainer.max_tokens_per_micro_batch": 16384,
}
"""The keys that take `auto` (colo.plan.auto resolves them per job and hardware), at the values they had before
auto: what auto gives on CPU (the CPU suite's settings) and what Settings.of fills in."""


def get(cfg: ColoConfig, key: str) -> Any:
    """cfg's value at a dotted key ("trainer.offload")."""
    section, _, leaf = key.partition(".")
    return getattr(getattr(cfg, section), leaf)


def with_values(cfg: ColoConfig, changes: dict[str, Any]) -> ColoConfig:
    """A copy of cfg with the dotted keys changed; every section is a fresh object (cfg is never modified)."""
    by_section: dict[str, dict[str, Any]] = {}
    for key, value in changes.items():
        section, _, leaf = key.partition(".")
        by_section.setdefault(section, {})[leaf] = value
    return dataclasses.replace(cfg, **{f.name: dataclasses.replace(getattr(cfg, f.name), **by_section.get(f.name, {}))
                                       for f in dataclasses.fields(cfg)})


def auto_keys(cfg: ColoConfig) -> list[str]:
    """The keys of PLAIN that are still `auto` in cfg."""
    return [k for k in PLAIN if get(cfg, k) == "auto"]


def settled(cfg: ColoConfig) -> dict[str, Any]:
    """The `auto`s the config alone decides (no device, no memory), for those still auto: {dotted key: value}.
    rollout.sleep_level: 2, the sync rewrites every weight, so level 1's host copy of them would be wasted work.
    trainer.old_logprobs: update when a step makes one update (trainer.epochs x trainer.mini_batches == 1: the policy
    before the step is the one that update's forward runs), else pass."""
    out: dict[str, Any] = {}
    if cfg.rollout.sleep_level == "auto":
        out["rollout.sleep_level"] = 2
    if cfg.trainer.old_logprobs == "auto":
        one = max(1, int(cfg.trainer.epochs)) * max(1, int(cfg.trainer.mini_batches)) == 1
        out["trainer.old_logprobs"] = "update" if one else "pass"
    return out


@dataclass(frozen=True)
class Settings:
    """A concrete ColoConfig, as the plan reads it (module docstring)."""
    cfg: ColoConfig

    def __post_init__(self) -> None:
        left = auto_keys(self.cfg) + list(settled(self.cfg))
        if left:
            raise ValueError(f"the memory plan needs concrete settings, but {', '.join(left)} "
                             f"{'is' if len(left) == 1 else 'are'} auto: resolve them first (colo.plan.auto)")

    @classmethod
    def from_config(cls, cfg: ColoConfig) -> Settings:
        return cls(with_values(cfg, {}))  # a copy: a caller changing cfg later does not change this plan

    @classmethod
    def of(cls, changes: dict[str, Any] | None = None) -> Settings:
        """ColoConfig's defaults, `changes` (dotted keys) on top, the trainer keys left at auto at PLAIN and the
        others as the config decides them (settled): tests' and benchmarks' plans, never a run's (colo.plan.resolve)."""
        cfg = with_values(ColoConfig(), dict(changes or {}))
        return cls(with_values(cfg, {**{k: PLAIN[k] for k in auto_keys(cfg)}, **settled(cfg)}))

    def with_(self, changes: dict[str, Any]) -> Settings:
        return Settings(with_values(self.cfg, changes))

    # ---- the config's sections the plan reads
    @property
    def placement(self) -> PlacementConfig:
        return self.cfg.placement

    @property
    def trainer(self) -> TrainerConfig:
        return self.cfg.trainer

    @property
    def rollout(self) -> RolloutConfig:
        return self.cfg.rollout

    @property
    def algo(self) -> AlgoConfig:
        return self.cfg.algo

    # ---- numbers derived from them
    @property
    def colocated(self) -> bool:
        return self.placement.mode == "colocated"

    @property
    def trainer_world(self) -> int:
        return self.placement.num_gpus if self.colocated else self.placement.trainer_gpus

    @property
    def engines(self) -> int:
        p = self.placement
        return p.num_gpus if self.colocated else max(1, (p.num_gpus - p.trainer_gpus) // self.rollout.tp_size)

    @property
    def batch_seqs(self) -> int:
        """Sequences one engine generates per step (prompts x n / engines)."""
        return -(-self.cfg.data.prompts_per_step * self.rollout.n // self.engines)

    @property
    def param_bytes(self) -> int:
        """Bytes of an element of the compute dtype (model.dtype)."""
        return 4 if self.cfg.model.dtype == "float32" else 2

    @property
    def state_bytes(self) -> int:
        """Bytes of an element of AdamW's exp_avg / exp_avg_sq (trainer.optimizer_dtype)."""
        return 2 if self.trainer.optimizer_dtype == "bfloat16" else 4

    @property
    def ref_model(self) -> bool:
        """algo.kl_coef > 0: a frozen fp32 copy of the policy."""
        return self.algo.kl_coef > 0

    @property
    def bucket_bytes(self) -> int:
        return self.cfg.sync.bucket_mb * 2**20

    @property
    def buffers(self) -> int:
        return self.cfg.sync.buffers

    @property
    def sleep_level(self) -> int:
        return int(self.rollout.sleep_level)

    @property
    def micro_tokens(self) -> int:
        """Token slots of the largest micro-batch: packed, the budget (or one sample of max_model_len when that
        is longer: it gets a micro-batch of its own); padded, micro_batch_size rows of max_model_len."""
        t, seq = self.trainer, self.rollout.max_model_len
        return max(int(t.max_tokens_per_micro_batch), seq) if t.packing else t.micro_batch_size * seq

    @property
    def micro_label(self) -> str:
        t = self.trainer
        seq = self.rollout.max_model_len
        return f"{self.micro_tokens} tok packed" if t.packing else f"{t.micro_batch_size}x{seq} tok"
