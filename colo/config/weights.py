"""A checkpoint's files, checked before anything starts: weights present and whole, a tokenizer that encodes,
and (at a real launch) every tensor of the safetensors headers against config.json's model.

validate() (colo.config.checks) runs check_weights from the files alone, so --dry-run says it too;
colo.materialize.make_run_dir runs check_model_readable, which imports transformers and torch, before the run dir exists.
"""
from __future__ import annotations

import json
from pathlib import Path

from colo.config.schema import AUTO, ColoConfig, ConfigError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def check_weights(cfg: ColoConfig) -> None:
    """A local checkpoint without weight files starts nothing useful: trainers and engines would fail
    one by one after Ray is up. (Hub repos are checked when downloaded; presets in _check_values.)"""
    local = Path(cfg.model.path).expanduser()
    if cfg.model.dummy_weights or cfg.model.path.startswith(AUTO) or not local.is_dir():
        return
    if not any(f.suffix in WEIGHT_SUFFIXES for f in local.iterdir() if f.is_file()):
        raise ConfigError(f"model.path={cfg.model.path} has a config.json but no weight files "
                          f"({'/'.join('*' + s for s in WEIGHT_SUFFIXES)}); fix: the checkpoint dir with its "
                          "weights, or model.dummy_weights=true for random weights")
    check_safetensors(local)
    check_tokenizer_files(local, cfg.model.path)


# what a tokenizer is saved as: without any of them transformers builds an empty one (1 token, every text -> [])
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tiktoken.model", "qwen.tiktoken")


def check_tokenizer_files(model_dir: Path, value: str) -> None:
    """A checkpoint dir must carry its tokenizer: prompts would otherwise encode to nothing ("sample 0: empty
    prompt" after the cluster started)."""
    if not any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(f"model.path={value} has no tokenizer (none of {', '.join(TOKENIZER_FILES[:4])}, ...); "
                          "fix: save the tokenizer of the model it comes from into it, e.g. AutoTokenizer."
                          f"from_pretrained(<base model>).save_pretrained('{value}')")


def check_safetensors(model_dir: Path) -> None:
    """Every *.safetensors file's header must parse and its tensors must end within the file: a truncated or
    corrupt file otherwise fails in trainer rank 0 after Ray started. Reads the headers only."""
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        problem = _safetensors_problem(f)
        if problem:
            raise ConfigError(f"model.path: {f} is {problem}; fix: re-download or re-save that file "
                              "(e.g. huggingface-cli download <repo> --local-dir <dir>)")


def _safetensors_problem(path: Path) -> str | None:
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or 8 + n > size:
                return f"truncated or not safetensors ({size} bytes, header of {max(n, 0)} bytes)"
            header = json.loads(fh.read(n))
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    except ValueError as e:
        return f"corrupt: its header is not JSON ({e})"
    tensors = [v for k, v in header.items() if k != "__metadata__"] if isinstance(header, dict) else [None]
    ends = [v["data_offsets"][1] for v in tensors if isinstance(v, dict) and isinstance(v.get("data_offsets"), list)
            and len(v["data_offsets"]) == 2 and isinstance(v["data_offsets"][1], int)]
    if len(ends) != len(tensors):
        return "corrupt: its header does not list tensors with data_offsets"
    need = 8 + n + max(ends, default=0)
    if need > size:
        return f"truncated: {size} bytes, its header needs {need}"
    return None


def check_model_readable(path: str, weights: bool = True) -> None:
    """transformers must read the checkpoint's config, its tokenizer must encode text, and (`weights`: not
    model.dummy_weights) every tensor of its safetensors headers must be what config.json's model holds
    (colo.models.headers). Imports transformers and torch: colo.launch runs it for a real launch only, after
    validate() and before the run dir is created, so nothing has started when it refuses."""
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 (whatever transformers raises: one line, exit 2)
        raise ConfigError(f"model.path={path}: transformers cannot read its config.json: {_one_line(e)}; fix: a "
                          "config.json written by save_pretrained of a supported family") from e
    check_tokenizer_files(Path(path), path)  # a Hub model, downloaded since validate(): its files too
    from colo.data.prompts import load_tokenizer

    try:
        ids = load_tokenizer(path)("Hello world")["input_ids"]
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"model.path={path}: its tokenizer cannot be loaded: {_one_line(e)}; fix: re-save the "
                          "tokenizer with save_pretrained into it") from e
    if not ids:
        raise ConfigError(f"model.path={path}: its tokenizer encodes text to no tokens (an empty vocabulary); fix: "
                          "save the tokenizer of the model it comes from into it (AutoTokenizer.save_pretrained)")
    if not weights:
        return
    check_safetensors(Path(path))
    from colo.models.headers import weight_problems

    try:
        problems = weight_problems(path)
    except Exception as e:  # noqa: BLE001 (transformers cannot build the config's model: one line, exit 2)
        raise ConfigError(f"model.path={path}: cannot build the model of its config.json to check its weights: "
                          f"{_one_line(e)}; fix: a config.json written by save_pretrained of a supported family") from e
    if problems:
        raise ConfigError(f"model.path={path}: its weights do not match its config.json: {'; '.join(problems)}; "
                          "fix: the config.json these weights were saved with, or the weights of this config")


def _one_line(e: BaseException) -> str:
    what = " ".join(str(e).split())  # one line, however many lines transformers wrote
    return f"{type(e).__name__}: " + (what if len(what) <= 240 else what[:237] + "...")
