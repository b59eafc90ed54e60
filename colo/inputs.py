"""What a run reads on the driver: tokenizer, training prompts, eval prompts, warm-up examples.

`colo.launch.prepare_run` has already generated any `auto:` model and data into the run dir and
resolved every path, so this module only opens files.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from colo.algo.data import PromptDataset
from colo.algo.tasks import completion, sft_examples
from colo.config import ColoConfig, ConfigError


@dataclass
class RunInputs:
    run_dir: Path
    tokenizer: Any
    train_data: PromptDataset
    eval_prompts: list[dict]
    sft_pairs: list[tuple[str, str]] = field(default_factory=list)
    chat_template: bool = False
    seed: int = 0

    def sft_batch(self, k: int, step: int) -> dict[str, torch.Tensor]:
        """k supervised examples (prompt → answer + EOS), loss on the answer tokens only.

        Drawn with a seed of (run seed, step) so a resumed warm-up sees the same examples."""
        rng = random.Random(f"sft:{self.seed}:{step}")
        pairs = [rng.choice(self.sft_pairs) for _ in range(k)]
        tok, rows = self.tokenizer, []
        for prompt, answer in pairs:
            text = (tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=False) if self.chat_template else prompt)
            p = tok(text, add_special_tokens=not self.chat_template)["input_ids"]
            r = tok(completion(answer, self.chat_template), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            rows.append((p, r))
        T = max(len(p) + len(r) for p, r in rows)
        ids = torch.full((k, T), tok.pad_token_id, dtype=torch.long)  # (B, T)
        attn = torch.zeros((k, T), dtype=torch.long)  # (B, T)
        mask = torch.zeros((k, T), dtype=torch.float32)  # (B, T) 1 on answer tokens
        for b, (p, r) in enumerate(rows):
            ids[b, : len(p) + len(r)] = torch.tensor(p + r)
            attn[b, : len(p) + len(r)] = 1
            mask[b, len(p): len(p) + len(r)] = 1.0
        return {"input_ids": ids, "attention_mask": attn, "loss_mask": mask}


def open_inputs(cfg: ColoConfig) -> RunInputs:
    """Raises ConfigError (colo.launch: one line, exit 2) for a data file that is missing, malformed or has a
    row without its prompt/answer field: before Ray or any engine starts, not when a shuffle reaches the row."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    chat = bool(cfg.data.chat_template and getattr(tok, "chat_template", None))
    keys = (cfg.data.prompt_key, cfg.data.answer_key)
    try:
        train = PromptDataset(cfg.data.path, *keys, tok, chat, seed=cfg.run.seed)
        evals: list[dict] = []
        if cfg.data.eval_path:
            ev = PromptDataset(cfg.data.eval_path, *keys, tok, chat, shuffle=False)
            evals = [ev.item(i) for i in range(min(len(ev), cfg.data.eval_size))]
        pairs = sft_examples(cfg.data.path, *keys) if cfg.loop.sft_warmup_steps else []
    except (OSError, ValueError) as e:  # read_rows names the file, the row and the field
        raise ConfigError(f"data: {e}") from e
    return RunInputs(Path(cfg.run.dir), tok, train, evals, pairs, chat, cfg.run.seed)
