"""verl's train file for the side-by-side: prompts whose chat-templated token ids are exactly --prompt-len long, as
colo.bench.step's random-id prompts are, in the parquet layout verl's RLHFDataset reads.

    python tools/peers/verl/prompts.py /tmp/peers/qwen3-30b-a3b-L4 /tmp/verl-prompts.parquet --count 80 --prompt-len 256

Each prompt is one user message of words from the checkpoint's own BPE corpus (colo.models.tokenizer), rendered by
the tokenizer's chat template with the generation prompt (what verl's single-turn agent loop sends to vLLM: its
Continuous Token builder renders the same ids, checked on CPU), grown word by word and then topped up with one-token
words until it has exactly prompt_len ids. The reward (tools/peers/verl/reward.py) reads only the response.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

FILLER = " a"  # one token in colo's BPE (checked: the top-up below raises otherwise)
DATA_SOURCE = "colo_peers"


def prompt_ids(tokenizer, text: str) -> list[int]:
    """The ids verl's rollout sends to vLLM for one user message `text`: the chat template with the generation
    prompt, tokenized."""
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return [int(i) for i in ids]


def make_text(tokenizer, length: int, rng: random.Random, cost: dict[str, int] | None = None) -> str:
    """A user message whose templated ids number exactly `length`: words drawn until their tokens (counted alone,
    `cost`) nearly fill it, then whole words dropped while the rendered prompt is too long, then FILLER added one token
    at a time (about ten renders a prompt)."""
    from colo.models.tokenizer import _WORDS

    words = " ".join(_WORDS).split()
    cost = cost or {w: len(tokenizer.encode(" " + w, add_special_tokens=False)) for w in words}
    target = length - len(prompt_ids(tokenizer, ""))
    picked: list[str] = []
    while sum(cost[w] for w in picked) < target - 8:
        picked.append(rng.choice(words))
    while picked and len(prompt_ids(tokenizer, " ".join(picked))) > length - 2:
        picked.pop()
    text = " ".join(picked)
    while (n := len(prompt_ids(tokenizer, text))) < length:
        text += FILLER
        if len(prompt_ids(tokenizer, text)) != n + 1:
            raise RuntimeError(f"{FILLER!r} is not one token after this text in this tokenizer")
    if n != length:
        raise RuntimeError(f"prompt overshot {length} tokens ({n})")
    return text


def write(model_dir: str, out: str, count: int, length: int, seed: int = 1234) -> Path:
    """The parquet file of `count` rows (verl's RLHFDataset columns) with prompts of exactly `length` ids."""
    import pandas as pd
    from transformers import AutoTokenizer

    from colo.models.tokenizer import _WORDS

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    cost = {w: len(tok.encode(" " + w, add_special_tokens=False)) for w in " ".join(_WORDS).split()}
    rows = [{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": make_text(tok, length, rng, cost)}],
             "ability": "bench", "reward_model": {"style": "rule", "ground_truth": "0"},
             "extra_info": {"index": i, "split": "train"}} for i in range(count)]
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    print(write(args.model_dir, args.out, args.count, args.prompt_len, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
