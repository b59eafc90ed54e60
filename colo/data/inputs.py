"""What a run reads on the driver: tokenizer, training prompts, eval prompts, warm-up examples.

`colo.materialize.make_run_dir` has already generated any `auto:` model and data into the run dir and
resolved every path, so this module only opens files.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from colo.algo.batch import pad_rows
from colo.data.prompts import PromptDataset, as_prompt, encode_prompt, load_tokenizer, pad_id, prompt_row
from colo.data.tasks import completion, sft_examples
from colo.config import ColoConfig, ConfigError, model_config_json


@dataclass
class RunInputs:
    run_dir: Path
    tokenizer: Any
    train_data: PromptDataset
    eval_prompts: list[dict]
    sft_pairs: list[tuple[str, str]] = field(default_factory=list)
    chat_template: bool = False
    seed: int = 0
    system_prompt: str | None = None
    environment: str | None = None  # algo.environment
    probe_vocab: int = 0  # token ids valid for the model and the tokenizer alike (colo.sync.probe's sequences)
    unsafe_tools: bool = False  # algo.unsafe_unsandboxed_tools
    holds: dict = field(default_factory=dict)  # what its checkpoints hold, recorded in each (colo.config.runfiles)
    _worker: Any = field(default=None, repr=False)  # colo.envs.offdriver.EnvWorker, made at the first demonstration
    _demos: dict = field(default_factory=dict, repr=False)  # (prompt, answer) -> demonstration

    def sft_batch(self, k: int, step: int) -> dict[str, torch.Tensor]:
        """k supervised examples (prompt → answer + EOS), loss on the answer tokens only. With an environment
        that has demonstrations (Environment.solution), each example is a whole conversation assembled the
        way a rollout is (colo.envs.framing, the environment's real answers), with loss on the model's turns.

        Drawn with a seed of (run seed, step) so a resumed warm-up sees the same examples."""
        rng = random.Random(f"sft:{self.seed}:{step}")
        tok, prompts, responses, masks = self.tokenizer, [], [], []
        pairs = [rng.choice(self.sft_pairs) for _ in range(k)]
        for (prompt, answer), conv in zip(pairs, self._demonstrations(pairs)):
            if conv is not None:
                prompts.append(conv["prompt_ids"])
                responses.append(conv["response_ids"])
                masks.append(conv["model_mask"])
                continue
            _, p = encode_prompt(tok, prompt, self.chat_template, self.system_prompt)
            r = tok(completion(answer, self.chat_template), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            prompts.append(p)
            responses.append(r)
            masks.append(1)
        batch = pad_rows(prompts, responses, masks, pad_id=pad_id(tok))  # right-padded, loss on r
        return {key: batch[key] for key in ("input_ids", "attention_mask", "loss_mask")}  # (B, T) each

    def _demonstrations(self, pairs: list[tuple[str, str]]) -> list[dict | None]:
        """The environment's demonstration of each (prompt, answer) row as a sample (model_mask on the model's
        turns), or None where there is no environment or it has no demonstration for the row. Built in the
        environment's own process (colo.envs.offdriver: the driver never runs environment or tool code), once per
        row."""
        if not self.environment:
            return [None] * len(pairs)
        todo = list(dict.fromkeys(p for p in pairs if p not in self._demos))
        if todo:
            if self._worker is None:
                from colo.envs.offdriver import EnvWorker

                self._worker = EnvWorker(self.environment, self.tokenizer, self.system_prompt, self.chat_template,
                                         self.unsafe_tools)
            rows = [prompt_row(p, a) for p, a in todo]
            self._demos.update(zip(todo, self._worker.demonstrations(rows)))
        return [self._demos[p] for p in pairs]


def open_inputs(cfg: ColoConfig) -> RunInputs:
    """Raises ConfigError (colo.launch: one line, exit 2) for a data file that is missing, malformed or has a
    row without its prompt/answer field: before Ray or any engine starts, not when a shuffle reaches the row."""
    tok = load_tokenizer(cfg.model.path)
    chat = uses_chat_template(cfg, tok)
    keys, system = (cfg.data.prompt_key, cfg.data.answer_key), cfg.data.system_prompt
    try:
        train = PromptDataset(cfg.data.path, *keys, tok, chat, seed=cfg.run.seed, system_prompt=system)
        evals: list[dict] = []
        if cfg.data.eval_path:
            ev = PromptDataset(cfg.data.eval_path, *keys, tok, chat, shuffle=False, system_prompt=system)
            evals = [ev.item(i) for i in range(min(len(ev), cfg.data.eval_size))]
        pairs = sft_examples(cfg.data.path, *keys) if cfg.loop.sft_warmup_steps else []
    except (OSError, ValueError) as e:  # read_rows names the file, the row and the field
        raise ConfigError(f"data: {e}") from e
    vocab = min(len(tok), int(model_config_json(cfg).get("vocab_size") or len(tok)))
    from colo.config.runfiles import holds

    return RunInputs(Path(cfg.run.dir), tok, train, evals, pairs, chat, cfg.run.seed, system, cfg.algo.environment,
                     vocab, cfg.algo.unsafe_unsandboxed_tools, holds=holds(cfg))


def check_first_turns(cfg: ColoConfig, tokenizer: Any, chat: bool, sources: list[tuple[str, list[dict]]]) -> None:
    """With algo.environment the first turn vLLM gets is what the environment's reset() returns, framed (a system
    message, a tool list), not the row's prompt: count its tokens for every row of every source (name, rows), in
    the environment's own process (colo.envs.offdriver). Raises ValueError naming the first row that leaves less
    than rollout.max_tokens of rollout.max_model_len; a row whose reset() raises is left to the run (its sample
    ends with the error), EnvError when the environment's process dies."""
    from colo.data.prompts import check_lengths
    from colo.envs.offdriver import EnvWorker

    with EnvWorker(cfg.algo.environment, tokenizer, cfg.data.system_prompt, chat,
                   cfg.algo.unsafe_unsandboxed_tools) as worker:
        for name, rows in sources:
            firsts = worker.first_prompts(rows)
            check_lengths([0 if isinstance(f, str) else len(f) for f in firsts], cfg.rollout.max_model_len,
                          cfg.rollout.max_tokens, name, what="its first turn (the environment's reset() messages)")


def uses_chat_template(cfg: ColoConfig, tokenizer: Any) -> bool:
    """Chat models (a tokenizer with a chat template) get it, unless data.chat_template is off; base models
    get raw text. A system prompt without a template is refused: there is no place to put it."""
    chat = bool(cfg.data.chat_template and getattr(tokenizer, "chat_template", None))
    if cfg.data.system_prompt and not chat:
        why = ("data.chat_template is false" if not cfg.data.chat_template else
               f"the tokenizer of model.path={cfg.model.path} has no chat template (a base model)")
        raise ConfigError(f"data.system_prompt is set but {why}; fix: drop data.system_prompt (or put the "
                          "instruction into the prompts)")
    return chat


def preview_prompt(cfg: ColoConfig) -> str:
    """The first training prompt as the model will see it, for --dry-run: from the checkpoint's own
    tokenizer (an auto: preset's is built in memory) and the first row of data.path (an auto: task's is
    generated). Raises OSError/ValueError when either cannot be had on this machine."""
    from colo.data.prompts import read_rows
    from colo.config import AUTO

    if cfg.model.path.startswith(AUTO):
        from colo.models.tiny import TOKENIZER_VOCAB, TOOL_PRESETS
        from colo.models.tokenizer import build_tokenizer

        tok = build_tokenizer(TOKENIZER_VOCAB, tools=cfg.model.path[len(AUTO):] in TOOL_PRESETS)
    else:
        tok = load_tokenizer(cfg.model.path, local_files_only=True)
    if cfg.data.path.startswith(AUTO):
        from colo.data.tasks import generate

        prompt = generate(cfg.data.path[len(AUTO):], 1, 0, cfg.run.seed)[0][0][0]
    else:
        rows = read_rows(cfg.data.path, [cfg.data.prompt_key, cfg.data.answer_key], cache_only=True,
                         text=[cfg.data.prompt_key])
        prompt = as_prompt(rows[0][cfg.data.prompt_key])
    chat = uses_chat_template(cfg, tok)
    text, ids = encode_prompt(tok, prompt, chat, cfg.data.system_prompt)
    how = "in the tokenizer's chat template" if chat else "raw text (no chat template)"
    return f"# first prompt, {how}, {len(ids)} tokens:\n{text!r}"
