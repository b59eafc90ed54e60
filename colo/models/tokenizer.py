"""A small byte-level BPE tokenizer for the tiny test models.

    from colo.models.tokenizer import build_tokenizer
    tok = build_tokenizer(vocab_size=512)        # transformers PreTrainedTokenizerFast
    tok.save_pretrained(out_dir)                 # tokenizer.json + tokenizer_config.json (with chat template)

Why our own tokenizer: tests and demos must run offline, and a 151k-entry vocabulary would make the
tiny model's embedding 100x bigger than the rest of it. The training corpus covers what the synthetic
tasks (colo.data.tasks) write — digits, `+ - * =`, "Question:", "Answer:", short words, the chat
markers — so prompts are a handful of tokens. Digits are split one per token (as Qwen does), so any
integer is spelled from the same ten tokens and the arithmetic answers 0-18 are 1-2 tokens.

Determinism: the corpus comes from a fixed-seed `random.Random`, and the BPE trainer breaks ties by
(count, pair) order, so the same vocab_size gives byte-identical tokenizer.json on every run (tested
by hashing in tests/unit/test_tiny_model.py). The tokenizer does not depend on the model seed.
"""
from __future__ import annotations

import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]  # ids 0, 1, 2
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]  # ids 3, 4 in the tools tokenizer (build_tokenizer(tools=True))

# Qwen-style ChatML, trimmed: no system prompt injection, no tool/think handling.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the a an of to and is in it you that he was for on are with as I his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how said "
    "each she which do their time if will way about many then them write would like so these her "
    "long make thing see him two has look more day could go come did number sound no most people my "
    "over know water than call first who may down side been now find any new work part take get "
    "place made live where after back little only round man year came show every good me give our "
    "under name very through just form sentence great think say help low line differ turn cause "
    "much mean before move right boy old too same tell does set three want air well also play small "
    "end put home read hand port large spell add even land here must big high such follow act why "
    "ask men change went light kind off need house picture try us again animal point mother world "
    "near build self earth father head stand own page should country found answer school grow study "
    "still learn plant cover food sun four between state keep eye never last let thought city tree "
    "question reverse letters sum difference product plus minus times equals zero five six seven "
    "eight nine ten eleven twelve user assistant system"
).split()


def _tool_lines(n_lines: int, seed: int) -> list[str]:
    """Conversations of the calc task (colo.data.tasks): a tool call, the tool's answer, the final answer."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(10, 99)
        expr, v = f"{a}*{b}+{c}", a * b + c
        lines.append(f"{IM_START}user\nCalculate {expr}.{IM_END}\n{IM_START}assistant\n{TOOL_TOKENS[0]}{expr}"
                     f"{TOOL_TOKENS[1]}{IM_END}\n{IM_START}tool\n{v}{IM_END}\n{IM_START}assistant\n{v}{IM_END}\n")
    return lines


def _corpus(n_lines: int = 6000, seed: int = 1234) -> list[str]:
    """Text in the shapes the tasks and chat template produce, plus plain English-ish filler."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    lines: list[str] = []
    for i in range(n_lines):
        kind = i % 5
        if kind == 0:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            op = rng.choice("+-*")
            val = a + b if op == "+" else a - b if op == "-" else a * b
            lines.append(f"Question: {a}{op}{b}=? Answer: {val}")
        elif kind == 1:
            w = "".join(rng.choice(letters) for _ in range(rng.randint(2, 5)))
            lines.append(f"Question: reverse {w} Answer: {w[::-1]}")
        elif kind == 2:
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            op = rng.choice("+-")
            val = a + b if op == "+" else a - b
            content = f"Question: {a}{op}{b}=? Answer:"
            lines.append(f"{IM_START}user\n{content}{IM_END}\n{IM_START}assistant\n{val}{IM_END}\n")
        else:
            n = rng.randint(4, 14)
            words = [rng.choice(_WORDS) for _ in range(n)]
            sent = " ".join(words).capitalize()
            lines.append(sent + rng.choice([".", "?", "!", ",", ":", ";"]))
    return lines


def build_tokenizer(vocab_size: int = 512, tools: bool = False) -> PreTrainedTokenizerFast:
    """Train the BPE and wrap it for transformers; len(result) == vocab_size (asserted). `tools`: the tool
    tokenizer of the tiny-tools preset: TOOL_TOKENS as special tokens (one id each, kept by decode for the
    environment) and the calc task's conversations in the corpus; without it, byte-identical to before."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + (TOOL_TOKENS if tools else []),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no <unk> ever
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus() + (_tool_lines(3000, 99) if tools else []), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=40960,
        clean_up_tokenization_spaces=False,
    )
    if len(fast) != vocab_size:
        raise RuntimeError(f"BPE reached {len(fast)} tokens, wanted {vocab_size}: enlarge the corpus")
    return fast
