"""Token-in/token-out: a conversation's ids are the ids vLLM sampled plus each observation tokenized once.

    framing = ChatFraming(tokenizer)
    conv = Conversation(framing.prompt([{"role": "user", "content": "2*3+4?"}]))
    conv.add_model(sampled_ids, sampled_logprobs)           # exactly what vLLM returned
    conv.add_env(framing.observation("10", "tool", after_eos=True))
    conv.ids  ==  the next turn's prompt, token for token

Why not render the whole chat again each turn: decoding the model's tokens and encoding the text again
does not give the same ids back (a sampled split like "1","2" re-encodes as "12"; whitespace and special
tokens move), so the trainer would score a sequence vLLM never saw (verl #6719, prime-rl #1352). Here the
history is never re-tokenized. An observation's ids come from the chat template itself: render a dummy
conversation whose assistant turn is a marker, followed by the observation messages and the generation
prompt, and tokenize the text after the marker: the template's closing of the assistant turn, the
observation's role header, its content, and the next assistant header. When the model's turn already ended
with the end-of-turn token (the template's closing starts with it), that part is dropped, as it is in the
sampled ids. The delta starts at a special token, so tokenizing it alone cannot merge across the boundary.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from colo.envs.base import EnvError, Observation, Prompt

MARK = "COLO_TURN_MARK_7f3a"


class ChatFraming:
    """How prompts and observations become token ids for one tokenizer (chat template or raw text)."""

    def __init__(self, tokenizer: Any, system_prompt: str | None = None, chat: bool | None = None) -> None:
        self.tok = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.eos_id = tokenizer.eos_token_id
        self.eos_text = tokenizer.eos_token or ""

    def encode(self, text: str, specials: bool = False) -> list[int]:
        return list(self.tok(text, add_special_tokens=specials)["input_ids"])

    def prompt(self, prompt: Prompt) -> list[int]:
        """The first prompt's ids: token ids as given, messages in the chat template with its generation
        prompt (as colo.data.prompts.encode_prompt renders a data row), or their contents as raw text."""
        if prompt and isinstance(prompt[0], int):
            return list(prompt)
        if not self.chat:
            return self.encode("\n".join(m["content"] for m in prompt), specials=True)
        text = self.tok.apply_chat_template(self.system + list(prompt), add_generation_prompt=True, tokenize=False)
        return self.encode(text)

    def observation(self, obs: Observation, role: str, after_eos: bool) -> list[int]:
        """The ids to append after a model turn: the framing delta of the observation messages (see the module
        docstring); token ids verbatim; [] for None. `after_eos`: the model's turn ended with end-of-turn."""
        if obs is None:
            return []
        if isinstance(obs, list) and (not obs or isinstance(obs[0], int)):
            return list(obs)
        messages = [{"role": role, "content": obs}] if isinstance(obs, str) else list(obs)
        if not self.chat:
            text = "".join("\n" + m["content"] + "\n" for m in messages)
            return ([] if after_eos or self.eos_id is None else [self.eos_id]) + self.encode(text)
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": MARK}]
        full = self.tok.apply_chat_template(base + messages, add_generation_prompt=True, tokenize=False)
        if full.count(MARK) != 1:
            raise EnvError("the chat template does not render an assistant turn's content verbatim; "
                           "observations cannot be framed with it")
        delta = full[full.index(MARK) + len(MARK):]
        if after_eos:
            if not (self.eos_text and delta.startswith(self.eos_text)):
                raise EnvError(f"the chat template closes an assistant turn with {delta[:20]!r}, not the "
                               f"end-of-turn token {self.eos_text!r} the model stopped at")
            delta = delta[len(self.eos_text):]
        return self.encode(delta)


@dataclass
class Conversation:
    """One sample in the making: prompt ids, then the response (model turns and observations) with a mask of
    which tokens the model sampled and vLLM's log-prob of each (0.0 on the environment's tokens)."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    model_mask: list[int] = field(default_factory=list)
    turns: int = 0

    @property
    def ids(self) -> list[int]:
        """Everything so far: the next turn's prompt."""
        return self.prompt_ids + self.response_ids

    def add_model(self, ids: list[int], logprobs: list[float]) -> None:
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} sampled tokens but {len(logprobs)} log-probs")
        self.response_ids += list(ids)
        self.logprobs += [float(x) for x in logprobs]
        self.model_mask += [1] * len(ids)
        self.turns += 1

    def add_env(self, ids: list[int]) -> None:
        self.response_ids += list(ids)
        self.logprobs += [0.0] * len(ids)
        self.model_mask += [0] * len(ids)
