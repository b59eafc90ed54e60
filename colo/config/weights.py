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


# vLLM 0.32's keys for a model's context (vllm/transformers_utils/model_arch_config_convertor.py: the smallest wins)
# and the RoPE types whose max_position_embeddings is already scaled (vllm/config/model.py, _get_and_verify_max_len)
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_target_positions",
                "max_sequence_length", "max_seq_length", "seq_len")
PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def model_context(model: dict, tokenizer_config: dict | None = None) -> tuple[float, str] | None:
    """The longest max_model_len vLLM accepts for this config.json (and tokenizer_config.json), with the key it comes
    from; None where vLLM would accept any (no key, or `model_max_length`, which vLLM lets a user exceed up to)."""
    text = model.get("text_config") or model
    if text.get("model_max_length") or model.get("model_max_length"):
        return None
    found = [(text[k], k) for k in CONTEXT_KEYS if isinstance(text.get(k), (int, float))]
    if not found:
        return None
    length, key = min(found)
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    ropes = [rope] if isinstance(rope, dict) and ("rope_type" in rope or "type" in rope or "factor" in rope) else (
        [r for r in rope.values() if isinstance(r, dict)] if isinstance(rope, dict) else [])
    factor = 1.0
    if "gemma3" not in str(text.get("model_type", model.get("model_type", ""))):
        for r in ropes:
            if r.get("rope_type", r.get("type")) not in PRESCALED_ROPE and isinstance(r.get("factor"), (int, float)):
                factor = float(r["factor"])
    length *= factor
    limit = (tokenizer_config or {}).get("model_max_length")
    if isinstance(limit, (int, float)) and limit < length:
        return float(limit), "model_max_length in tokenizer_config.json"
    return float(length), key + (f" x RoPE factor {factor:g}" if factor != 1.0 else "")


def check_context_length(cfg: ColoConfig, model: dict) -> None:
    """rollout.max_model_len past the model's context is refused here, not by vLLM inside every engine after Ray
    started ("User-specified max_model_len ... is greater than the derived max_model_len"). Honours vLLM's own way
    round it, VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."""
    import os

    local = Path(cfg.model.path).expanduser()
    tok = local / "tokenizer_config.json"
    try:
        tokenizer = json.loads(tok.read_text()) if not cfg.model.path.startswith(AUTO) and tok.is_file() else None
    except (OSError, ValueError):
        tokenizer = None  # check_model_readable names an unreadable tokenizer
    context = model_context(model, tokenizer if isinstance(tokenizer, dict) else None)
    want = cfg.rollout.max_model_len
    if context is None or want <= context[0] or os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "") in ("1", "true"):
        return
    length, key = int(context[0]), context[1]
    raise ConfigError(f"rollout.max_model_len={want} is longer than the model's context ({key}: {length} in "
                      f"model.path={cfg.model.path}), which vLLM refuses; fix: rollout.max_model_len={length} (and "
                      f"rollout.max_tokens below it), or VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 if the model truly handles more")
