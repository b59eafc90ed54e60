"""Prompt data: JSONL/Parquet files or Hugging Face datasets -> tokenized prompt batches, shuffled per
epoch, resumable.

Sources (`data.path`, `data.eval_path`; DataSource.parse):
    /data/train.jsonl | .parquet        a file, one row per prompt
    /data/gsm8k_disk[:split]            a dir written by datasets' save_to_disk (a DatasetDict needs :split)
    openai/gsm8k:main:train             a Hub dataset id[:config]:split, through datasets' cache
                                        (HF_DATASETS_OFFLINE=1 / HF_HUB_OFFLINE=1 use the cache only)

    ds = PromptDataset("arith_train.jsonl", "prompt", "answer", tokenizer, chat_template=False, seed=0)
    batch = ds.next_batch(8)     # [{"prompt_ids": [int], "prompt_text": str, "answer": str, "prompt": str}] * 8
                                 # (+ "messages": [{"role", "content"}] for a chat-format prompt)
    state = ds.state_dict()      # {"epoch", "pos", "seed", "num_rows"}: store it in the checkpoint
    ds.load_state_dict(state)    # the next next_batch() continues exactly where the saved one left off

Order: epoch e visits every row once in a permutation drawn from Random(f"{seed}:{e}"), so the
order depends only on (seed, epoch), not on batch sizes or on how often the run was resumed. A batch
that reaches the end of an epoch continues into the next one (no short or dropped batches).

A prompt is text, or chat messages (`[{"role": "user", "content": "..."}, ...]`: verl's and TRL's conversational
`prompt` column), rendered with the tokenizer's chat template (data.system_prompt goes first where they have no
system message). The text rewards and environments see is a text prompt itself, or the messages' last user turn;
an environment also gets the messages (row["messages"]). data.answer_key may name a field inside a column with
dots (verl's `reward_model.ground_truth`).

Rows are validated when the file is read, so a bad row fails at start-up with the file, row number
and missing field, not hours later when a shuffle happens to reach it.
"""
from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


FILE_SUFFIXES = (".jsonl", ".json", ".ndjson", ".parquet")  # .json is JSON lines
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

Prompt = str | tuple[tuple[str, str], ...]  # text, or chat messages as (role, content) pairs: hashable, one order


def as_prompt(value: Any) -> Prompt | None:
    """A row's prompt field as text or messages; None where it is neither (a number, a dict, a list of strings)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        return tuple((m["role"], m["content"]) for m in value)
    return None


def messages(prompt: Prompt) -> list[dict[str, str]]:
    """Chat messages of a prompt: a text prompt is one user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": role, "content": content} for role, content in prompt]


def question(prompt: Prompt) -> str:
    """The text rewards and environments get: a text prompt, or the messages' last user turn (else the last)."""
    if isinstance(prompt, str):
        return prompt
    return next((content for role, content in reversed(prompt) if role == "user"), prompt[-1][1])


def prompt_row(prompt: Prompt, answer: str) -> dict[str, Any]:
    """{"prompt": its text, "answer"}, and "messages" for a chat-format prompt (environments start from them)."""
    row: dict[str, Any] = {"answer": answer, "prompt": question(prompt)}
    if not isinstance(prompt, str):
        row["messages"] = messages(prompt)
    return row


def column(key: str) -> str:
    """The column a data key reads: "reward_model.ground_truth" -> "reward_model"."""
    return key.split(".", 1)[0]


def field_of(row: dict, key: str) -> Any:
    """row[key], where dots walk into nested fields (None where a level is missing)."""
    if key in row:  # a column whose name has a dot
        return row[key]
    value: Any = row
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


@dataclass(frozen=True)
class DataSource:
    kind: str  # "file" | "disk" (save_to_disk dir) | "hub"
    path: str  # file or dir path, or the Hub id
    config: str | None = None  # hub: the dataset's config (e.g. gsm8k's "main")
    split: str | None = None  # disk (DatasetDict) and hub: which split

    @classmethod
    def parse(cls, value: str) -> DataSource:
        """What a data.path value names; nothing is read. A value that exists on disk is a path even if it
        holds ':'; otherwise ':'-separated parts after the first are [config:]split."""
        path = Path(value).expanduser()
        if path.is_dir():
            return cls("disk", str(path))
        if path.exists() or path.suffix in FILE_SUFFIXES:
            return cls("file", str(path))
        base, *rest = value.split(":")
        if Path(base).expanduser().is_dir() and len(rest) == 1:
            return cls("disk", str(Path(base).expanduser()), split=rest[0])
        if _REPO_ID.fullmatch(base) and not base.startswith(".") and len(rest) <= 2:
            config, split = (rest[0], rest[1]) if len(rest) == 2 else (None, rest[0] if rest else "train")
            return cls("hub", base, config=config or None, split=split)
        return cls("file", str(path))  # missing: read_rows / the config check say so

    def resolved(self) -> str:
        """The same source with an absolute path (what the run dir's config.yaml records)."""
        if self.kind == "hub":
            return self.spec()
        return DataSource(self.kind, str(Path(self.path).resolve()), self.config, self.split).spec()

    def spec(self) -> str:
        return ":".join(x for x in (self.path, self.config, self.split) if x)


def dataset_columns(source: DataSource) -> list[str]:
    """Column names of a save_to_disk dir (memory-mapped: cheap), for the config check."""
    return list(_open_dataset(source).column_names)


def _open_dataset(source: DataSource, cache_only: bool = False) -> Any:
    import datasets

    if source.kind == "hub" and cache_only:
        try:
            return _load_from_cache(source)
        except (ValueError, FileNotFoundError, ConnectionError, OSError) as e:
            raise ValueError(f"Hugging Face dataset {source.spec()} is not in this machine's datasets cache "
                             "(a dry run downloads nothing; the run itself will)") from e
    if source.kind == "hub":
        try:
            return datasets.load_dataset(source.path, source.config, split=source.split)
        except (ValueError, FileNotFoundError, ConnectionError, OSError) as e:
            raise ValueError(f"Hugging Face dataset {source.spec()}: {type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''} (no network and not in the datasets "
                             "cache? save it with save_to_disk where the Hub is reachable and point data.path "
                             "at that dir)") from e
    try:
        ds = datasets.load_from_disk(source.path)
    except FileNotFoundError as e:
        raise ValueError(not_a_dataset(Path(source.path))) from e
    if isinstance(ds, datasets.DatasetDict):
        if source.split is None or source.split not in ds:
            what = "needs a split" if source.split is None else f"has no split {source.split!r}"
            raise ValueError(f"{source.path} is a DatasetDict with splits {sorted(ds)}, so data.path {what}; "
                             f"fix: {source.path}:{sorted(ds)[0]}")
        ds = ds[source.split]
    elif source.split is not None:
        raise ValueError(f"{source.path} is a single dataset (no splits), but data.path names split "
                         f"{source.split!r}; fix: drop ':{source.split}'")
    return ds


def not_a_dataset(folder: Path) -> str:
    """What to say about a data.path folder that datasets' load_from_disk does not take, with the fix."""
    files = sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    data = [f for f in files if Path(f).suffix in FILE_SUFFIXES]
    if not data:  # a Hub download (huggingface-cli download --repo-type dataset): data/train-00000-of-00001.parquet
        data = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.suffix in FILE_SUFFIXES
                      and p.is_file() and not any(x.startswith(".") for x in p.relative_to(folder).parts))
        files = files + data
    held = f"it holds {', '.join(files[:4])}{', ...' if len(files) > 4 else ''}" if files else "it is empty"
    one = (f"point data.path at one file (e.g. data.path={folder / data[0]})" + (
        ", or join them into one JSONL or Parquet file" if len(data) > 1 else "")) if data else \
        "point data.path at a JSONL or Parquet file"
    return (f"{folder}: a folder, but not a dataset written by datasets' save_to_disk (no dataset_info.json or "
            f"dataset_dict.json); {held}; fix: {one}, or save the dataset with save_to_disk into a folder of its own")


def _load_from_cache(source: DataSource) -> Any:
    """load_dataset with the Hub switched off for this call: without a network, the online call retries for
    ~25 s before it gives up, too long for --dry-run, which must not download anyway."""
    import datasets
    import huggingface_hub.constants as hub

    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        return datasets.load_dataset(source.path, source.config, split=source.split)
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


def read_rows(path: str | os.PathLike, required: Sequence[str], cache_only: bool = False,
              text: Sequence[str] = ()) -> list[dict[str, Any]]:
    """All rows of a .jsonl/.json-lines or .parquet file, or of a Hugging Face dataset (DataSource);
    every row must have every `required` field (dots: a nested one), and the `text` fields (the prompt) must be
    text or chat messages (as_prompt). cache_only: a Hub dataset only from the local cache."""
    source = DataSource.parse(str(path))
    if source.kind != "file":
        ds = _open_dataset(source, cache_only)
        missing = [k for k in required if column(k) not in ds.column_names]
        if missing:
            raise ValueError(f"{source.spec()}: no column {column(missing[0])!r} (columns: "
                             f"{sorted(ds.column_names)}); fix: data.prompt_key=/data.answer_key= to name them")
        wanted = list(dict.fromkeys(column(k) for k in required))
        rows = ds.select_columns(wanted).to_list()  # only those columns: datasets can be wide
        return check_rows(rows, [f"row {i}" for i in range(len(rows))], required, source.spec(), text)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data file not found: {path}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        where = [f"row {i}" for i in range(len(rows))]
    elif path.suffix in (".jsonl", ".json", ".ndjson"):
        rows, where = [], []
        with open(path, "rb") as f:  # decoded line by line: a bad byte is named by its line, not a decode chunk
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path}: line {lineno}: not UTF-8 (byte {raw[e.start]:#04x} at column "
                                     f"{e.start + 1}); fix: re-encode the file as UTF-8, e.g. iconv -f latin1 "
                                     f"-t utf-8") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: row {len(rows)} (line {lineno}): invalid JSON: {e}") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}: row {len(rows)} (line {lineno}): expected a JSON object, "
                                     f"got {type(row).__name__}")
                rows.append(row)
                where.append(f"row {len(rows) - 1} (line {lineno})")
    else:
        raise ValueError(f"{path}: unsupported data format {path.suffix!r}; use .jsonl or .parquet")
    return check_rows(rows, where, required, str(path), text)


def read_examples(path: str | os.PathLike, prompt_key: str, answer_key: str,
                  cache_only: bool = False) -> list[tuple[Prompt, str]]:
    """(prompt, answer) of every row (read_rows, checked): the prompt text or messages, the answer as text."""
    rows = read_rows(path, [prompt_key, answer_key], cache_only, text=[prompt_key])
    return [(as_prompt(r[prompt_key]), str(field_of(r, answer_key))) for r in rows]


def check_rows(rows: list[dict], where: list[str], required: Sequence[str], name: str,
               text: Sequence[str] = ()) -> list[dict]:
    """Every row has its `required` fields, its `text` fields (the prompt) are text or chat messages and the others
    (the answer) one value each; raises ValueError naming the first row that does not (`where`: each row's place)."""
    for row, at in zip(rows, where):
        for key in required:
            if field_of(row, key) is None:  # Parquet and datasets fill absent values with None: missing too
                raise ValueError(f"{name}: {at}: missing field {key!r} (row has fields {sorted(row)})")
        for key in text:
            if as_prompt(row[key]) is None:
                raise ValueError(f"{name}: {at}: field {key!r} is {type(row[key]).__name__} {str(row[key])[:40]}, "
                                 f"not text or chat messages; fix: data.prompt_key= the field that holds the prompts, "
                                 "or write them as strings or as [{\"role\": \"user\", \"content\": ...}] lists")
        for key in (k for k in required if k not in text):  # the answer: rewards compare it as text
            value = field_of(row, key)
            if isinstance(value, dict):
                raise ValueError(f"{name}: {at}: field {key!r} holds fields {sorted(value)}, not an answer (rewards "
                                 f"would compare against its text and score 0); fix: data.answer_key={key}."
                                 f"{_likely(value)} (dots name a nested field)")
            if isinstance(value, (list, tuple)):
                raise ValueError(f"{name}: {at}: field {key!r} is a list {str(value)[:40]}, not one answer (rewards "
                                 "compare against text and would score its repr); fix: data.answer_key= a field with "
                                 "one answer per row")
    if not rows:
        raise ValueError(f"{name}: no rows (the file is empty); fix: a file with one row per prompt")
    return rows


def _likely(fields: dict) -> str:
    """The nested field an answer most likely is (verl: ground_truth)."""
    for name in ("ground_truth", "answer", "solution", "target"):
        if name in fields:
            return name
    return sorted(fields)[0]


def check_prompt_lengths(prompts: Sequence[Prompt], tokenizer: Any, chat_template: bool, system_prompt: str | None,
                         max_model_len: int, max_tokens: int, name: str) -> None:
    """Every prompt, as the engine will get it, must leave rollout.max_tokens of rollout.max_model_len for its
    response: vLLM refuses a longer prompt only at the first rollout (after the warm-up), and a prompt that
    leaves less room gets its responses cut short of max_tokens. Raises ValueError naming the first such row,
    how many there are, and the fix."""
    lengths = [len(encode_prompt(tokenizer, p, chat_template, system_prompt)[1]) for p in prompts]
    check_lengths(lengths, max_model_len, max_tokens, name)


def check_lengths(lengths: Sequence[int], max_model_len: int, max_tokens: int, name: str,
                  what: str = "its prompt") -> None:
    """check_prompt_lengths on token counts already known (`what` names them: an environment's first turn)."""
    budget = max_model_len - max_tokens
    over = [i for i, n in enumerate(lengths) if n > budget]
    if not over:
        return
    first, longest = over[0], max(lengths)
    room = (f"longer than rollout.max_model_len={max_model_len}" if lengths[first] > max_model_len else
            f"leaves {max_model_len - lengths[first]} tokens of rollout.max_model_len={max_model_len} for a "
            f"response of rollout.max_tokens={max_tokens}")
    raise ValueError(f"{name}: row {first}: {what} is {lengths[first]} tokens, {room}; {len(over)} of "
                     f"{len(lengths)} rows are too long (the longest: {longest} tokens); fix: "
                     f"rollout.max_model_len={longest + max_tokens}, or drop or shorten those rows")


# transformers' generic fast tokenizer, by its 4.x name and by the one 5.x writes (one class in 5.x)
GENERIC_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_tokenizer(path: str | os.PathLike, **kwargs: Any) -> Any:
    """The checkpoint's tokenizer, as `AutoTokenizer.from_pretrained(path, **kwargs)` loads it. Where the local
    tokenizer_config.json names transformers' generic fast tokenizer (colo's tiny models, Llama 3, ...) and no
    remote code, that class is loaded directly: AutoTokenizer picks the same class, but first imports
    transformers' model-config and generation machinery, ~3 CPU-s of every driver's start-up (measured with torch
    already imported, on a 2-core machine). Any other tokenizer goes through AutoTokenizer."""
    try:
        named = json.loads((Path(path) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        named = {}
    if named.get("tokenizer_class") in GENERIC_TOKENIZERS and "auto_map" not in named:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path, **kwargs)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, **kwargs)


def pad_id(tokenizer: Any) -> int:
    """The id a padded position holds (masked out of attention and loss: any valid id will do): the tokenizer's pad
    token, else its end of sequence (Llama 3's and many base models' tokenizers define no pad token), else 0."""
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(value, int):
            return value
    return 0


def encode_prompt(tokenizer: Any, prompt: Prompt, chat_template: bool,
                  system_prompt: str | None = None) -> tuple[str, list[int]]:
    """(text the model sees, its token ids): the chat template applied when enabled, with the system
    prompt as its first message when given (and the prompt's messages have none). Rollout prompts and the
    warm-up's supervised examples both go through here, so they are tokenized identically."""
    if not chat_template:
        if system_prompt:  # colo.data.inputs refuses this combination before anything starts
            raise ValueError("a system prompt needs a chat template")
        if not isinstance(prompt, str):
            raise ValueError("chat-format prompts (role/content messages) need the tokenizer's chat template, and "
                             "data.chat_template is false or the tokenizer has none; fix: data.chat_template=true "
                             "with a chat model, or text prompts")
        text = prompt
    else:
        chat = messages(prompt)
        system = [{"role": "system", "content": system_prompt}] if system_prompt and not any(
            m["role"] == "system" for m in chat) else []
        text = tokenizer.apply_chat_template(system + chat, add_generation_prompt=True, tokenize=False)
    # A rendered chat template already carries any BOS; a raw prompt gets the tokenizer's specials.
    return text, list(tokenizer(text, add_special_tokens=not chat_template)["input_ids"])


class PromptDataset:
    """Prompts and reference answers from one file, tokenized on demand (see module docstring)."""

    def __init__(self, path: str | os.PathLike, prompt_key: str = "prompt", answer_key: str = "answer",
                 tokenizer: Any = None, chat_template: bool = False, seed: int = 0,
                 shuffle: bool = True, system_prompt: str | None = None) -> None:
        """`tokenizer`: a transformers tokenizer or a path to load one from (load_tokenizer)."""
        if tokenizer is None:
            raise ValueError("PromptDataset needs a tokenizer (object or path)")
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = load_tokenizer(tokenizer)
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"chat_template=True but tokenizer {tokenizer.name_or_path!r} has no chat template")
        self.path = str(path)  # a file, or a dataset source spec (DataSource)
        examples = read_examples(self.path, prompt_key, answer_key)
        self.prompts: list[Prompt] = [p for p, _ in examples]
        self.answers = [a for _, a in examples]
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.pos = 0  # rows of the current epoch already handed out
        self._order_epoch = -1
        self._order: list[int] = []

    def __len__(self) -> int:
        return len(self.prompts)

    def prompt_text(self, i: int) -> str:
        """Row i's prompt as the model sees it (chat template applied when enabled)."""
        return encode_prompt(self.tokenizer, self.prompts[i], self.chat_template, self.system_prompt)[0]

    def item(self, i: int) -> dict[str, Any]:
        text, ids = encode_prompt(self.tokenizer, self.prompts[i], self.chat_template, self.system_prompt)
        return {"prompt_ids": ids, "prompt_text": text, **prompt_row(self.prompts[i], self.answers[i])}

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            order = list(range(len(self)))
            if self.shuffle:
                random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def next_batch(self, k: int) -> list[dict[str, Any]]:
        """The next k prompts in shuffled order, crossing into the next epoch when one runs out."""
        if k <= 0:
            raise ValueError(f"batch size must be positive, got {k}")
        out = []
        while len(out) < k:
            order = self._epoch_order(self.epoch)
            take = min(k - len(out), len(order) - self.pos)
            out.extend(self.item(i) for i in order[self.pos:self.pos + take])
            self.pos += take
            if self.pos == len(order):
                self.epoch, self.pos = self.epoch + 1, 0
        return out

    def sequential(self, k: int) -> Iterator[list[dict[str, Any]]]:
        """File-order batches over every row once (eval); does not move the training position."""
        for start in range(0, len(self), k):
            yield [self.item(i) for i in range(start, min(start + k, len(self)))]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed, "num_rows": len(self)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        # A changed file or seed would silently resume at a different place: refuse instead.
        if state["num_rows"] != len(self) or state["seed"] != self.seed:
            raise ValueError(f"{self.path}: saved data position is for {state['num_rows']} rows / seed "
                             f"{state['seed']}, but the dataset has {len(self)} rows / seed {self.seed}")
        if not 0 <= state["pos"] < len(self):
            raise ValueError(f"{self.path}: saved position {state['pos']} out of range [0, {len(self)})")
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
