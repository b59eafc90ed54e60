"""What a run started from, kept in its run dir so that a resume can tell it is the same run.

    write_origin(run_dir, specs, config_file, file_values, tokenizer_dir, data_files)   # at the start, once
    origin = read_origin(run_dir)                  # at every --resume; OriginError when missing or damaged
    changed = origin_changes(origin, tokenizer_dir, data_files)   # ["the tokenizer of model.path ... changed", ...]
    digest = weights_digest(model_dir)             # what a LoRA checkpoint's base was (colo.config.runfiles)

<run.dir>/origin.json holds the model and data as they were given (`auto:tiny`: the saved config only has the
folder it was generated into), the values of the --config file the run started with (so a resume given that same
file changes nothing, and another file's differences are known), and fingerprints of what gives the checkpoints
their meaning besides the weights: the tokenizer's files and the data files. A checkpoint trained under one
tokenizer and resumed under another, or whose data position points into another file, would train on silently.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

NAME = "origin.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "vocab.txt", "spiece.model", "special_tokens_map.json", "chat_template.jinja")
WHOLE = 1 << 30  # files up to 1 GiB are hashed whole; larger ones by size and their first and last 64 MiB


def fingerprint(path: str | os.PathLike) -> str | None:
    """sha256 of a file (see WHOLE), or of a folder's file names and sizes (a save_to_disk dataset); None when
    it is neither (a Hub dataset id)."""
    p = Path(path)
    h = hashlib.sha256()
    if p.is_file():
        size = p.stat().st_size
        h.update(str(size).encode())
        with open(p, "rb") as f:
            if size <= WHOLE:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            else:
                h.update(f.read(64 << 20))
                f.seek(size - (64 << 20))
                h.update(f.read())
        return h.hexdigest()
    if p.is_dir():
        for f in sorted(q for q in p.rglob("*") if q.is_file()):
            h.update(f"{f.relative_to(p)}:{f.stat().st_size}\n".encode())
        return h.hexdigest()
    return None


def tokenizer_fingerprint(model_dir: str | os.PathLike) -> dict[str, str]:
    """file name -> fingerprint of each tokenizer file in the checkpoint dir."""
    return {name: fingerprint(Path(model_dir) / name) for name in TOKENIZER_FILES
            if (Path(model_dir) / name).is_file()}


def write_origin(run_dir: str | os.PathLike, specs: dict[str, Any], config_file: str | None,
                 file_values: dict[str, Any], tokenizer_dir: str, data_files: dict[str, str | None]) -> Path:
    """<run_dir>/origin.json, written once at the start of a run (never on resume)."""
    record = {"specs": specs, "config_file": {"path": config_file, "values": file_values},
              "tokenizer": tokenizer_fingerprint(tokenizer_dir),
              "data": {key: fingerprint(path) if path else None for key, path in data_files.items()}}
    path = Path(run_dir) / NAME
    tmp = path.with_name(f".{NAME}.tmp")  # whole or not there: a torn record would refuse every resume
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


KEYS = {"specs": dict, "config_file": dict, "tokenizer": dict, "data": dict}  # what a record holds, and as what


class OriginError(ValueError):
    """origin.json is missing or damaged: one line naming the file and the fix (a resume that cannot tell whether
    the tokenizer and the data are the run's own is refused, never continued unchecked)."""


def read_origin(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The record; OriginError when it is missing, unreadable or lacks a part (emptied or edited: a resume would
    otherwise continue on changed data without a word)."""
    path = Path(run_dir) / NAME
    fix = ("fix: restore it from a copy of the run dir (it is written once, when the run starts); without it a "
           "resume cannot tell whether the tokenizer and the data are the ones the run was trained on")
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise OriginError(f"--resume: {path} is missing; {fix}") from None
    except (OSError, ValueError) as e:
        raise OriginError(f"--resume: {path} is unreadable ({type(e).__name__}: {e}); {fix}") from e
    if not isinstance(record, dict):
        raise OriginError(f"--resume: {path} holds a {type(record).__name__}, not colo's record; {fix}")
    for key, kind in KEYS.items():
        if not isinstance(record.get(key), kind):
            raise OriginError(f"--resume: {path} lacks its {key!r} part (or it is not a {kind.__name__}); {fix}")
    return record


SAMPLED = 64 << 20  # a weights file up to this size is hashed whole; a larger one by SAMPLES pieces spread over it
SAMPLES, PIECE = 16, 1 << 20


def weights_digest(model_dir: str | os.PathLike) -> str:
    """sha256 over a checkpoint's *.safetensors files: each file's name, size and header (names, shapes, dtypes,
    offsets) and its data (whole up to SAMPLED bytes, else SAMPLES pieces of PIECE bytes spread evenly: ~16 MiB
    per file, a second for a 30B model). Another checkpoint put in the same place is seen; an edit of one tensor
    of a large file may not be."""
    h = hashlib.sha256()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}\n".encode())
        with open(f, "rb") as fh:
            if size <= SAMPLED:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
                continue
            head = int.from_bytes(fh.read(8), "little")  # the safetensors header's length
            h.update(fh.read(min(head, size - 8)))
            for k in range(SAMPLES):
                fh.seek((size - PIECE) * k // (SAMPLES - 1))
                h.update(fh.read(PIECE))
    return h.hexdigest()


def origin_changes(origin: dict[str, Any], tokenizer_dir: str, data_files: dict[str, str | None]) -> list[str]:
    """What changed on disk since the run started: its tokenizer's files, its data files (each one phrase)."""
    out = []
    now = tokenizer_fingerprint(tokenizer_dir)
    then = origin.get("tokenizer", {})
    differ = sorted(n for n in set(now) | set(then) if now.get(n) != then.get(n))
    if then and differ:
        out.append(f"the tokenizer of model.path ({tokenizer_dir}) changed since the run started ({', '.join(differ)})")
    for key, path in data_files.items():
        was = origin.get("data", {}).get(key)
        if was is not None and path and Path(path).exists() and fingerprint(path) != was:  # gone: the launch says so
            out.append(f"{key} ({path}) changed since the run started (its content differs)")
    return out
