"""A checkpoint directory written whole or not at all, once: what colo.models.tiny and .families share.

    out = build_once(out_dir, "colo_preset.json", {"preset": "tiny", "seed": 0, ...}, write)

`write(tmp)` fills a sibling temp dir; the marker (the JSON given, written last) says what the directory
holds, so a second call with the same marker returns at once and a different marker rebuilds. Safe to race:
concurrent callers (test workers, engines on one host) each build in their own temp dir and move it into
place with one rename; a loser whose rename fails finds the winner's marker and returns. A directory that
holds something else is replaced file by file with the marker removed first and written last, so a reader
never sees a marker over mixed files.

    out = build_cached(out_dir, "colo_preset.json", marker, write, sources=[__file__])

does the same through a per-user cache ($XDG_CACHE_HOME/colo/models, else ~/.cache/colo/models): the first
build of a marker is kept there and later calls copy its files (byte-identical) instead of building again.
Building a tiny preset imports transformers' modeling code and initializes the model (~5 CPU-s on a
2-core machine); every `python -m colo.launch` of a tiny config paid it, the test suite ~35
times. A cache entry is keyed by the marker, the versions of the packages that write the bytes and the writer's
source files, so an upgrade or an edit builds a fresh one; a cache that cannot be written is skipped.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path

WRITERS = ("torch", "transformers", "tokenizers", "safetensors")  # the packages whose versions can change the bytes


def is_built(out_dir: str | os.PathLike, marker_name: str, marker: dict) -> bool:
    try:
        return json.loads((Path(out_dir) / marker_name).read_text()) == marker
    except (OSError, ValueError):
        return False


def build_once(out_dir: str | os.PathLike, marker_name: str, marker: dict, write: Callable[[Path], None]) -> Path:
    """out_dir (resolved) holding what `write` produces, marked with `marker`; built only when it is not."""
    out = Path(out_dir).resolve()
    if is_built(out, marker_name, marker):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write(tmp)
        (tmp / marker_name).write_text(json.dumps(marker, sort_keys=True) + "\n")
        try:
            os.rename(tmp, out)  # atomic when out does not exist (or is an empty dir)
        except OSError:
            if is_built(out, marker_name, marker):  # a concurrent caller won the race
                return out
            # out holds something else: replace file by file, marker last, stale files removed
            (out / marker_name).unlink(missing_ok=True)
            new_names = {p.name for p in tmp.iterdir()}
            for p in out.iterdir():
                if p.is_dir():  # a checkpoint holds files only: a dir here is stale, and would block os.replace
                    shutil.rmtree(p)
                elif p.name not in new_names:
                    p.unlink()
            for p in sorted(tmp.iterdir(), key=lambda p: p.name == marker_name):
                os.replace(p, out / p.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def cache_root() -> Path:
    """Where built checkpoints are kept between runs: $XDG_CACHE_HOME/colo/models, else ~/.cache/colo/models."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "colo" / "models"


def cache_key(marker: dict, sources: Iterable[str | os.PathLike]) -> str:
    """A short digest of what decides the bytes: the marker, the writer packages' versions, the writer's source."""
    h = hashlib.sha256(json.dumps(marker, sort_keys=True).encode())
    for name in WRITERS:
        try:
            h.update(f"{name}=={metadata.version(name)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{name} missing".encode())
    for src in sources:
        h.update(Path(src).read_bytes())
    return h.hexdigest()[:16]


def _copy_files(src: Path, marker_name: str) -> Callable[[Path], None]:
    def write(tmp: Path) -> None:
        for p in src.iterdir():
            if p.is_file() and p.name != marker_name:  # build_once writes the marker last
                shutil.copy2(p, tmp / p.name)
    return write


def build_cached(out_dir: str | os.PathLike, marker_name: str, marker: dict, write: Callable[[Path], None],
                 sources: Iterable[str | os.PathLike]) -> Path:
    """build_once through the per-user cache: built there once, copied into out_dir (module docstring)."""
    if is_built(out_dir, marker_name, marker):
        return Path(out_dir).resolve()
    name = "-".join(str(v) for k, v in sorted(marker.items()) if k in ("preset", "family", "name", "seed"))
    try:
        cached = build_once(cache_root() / f"{name}-{cache_key(marker, sources)}", marker_name, marker, write)
    except OSError:  # a read-only or full home: build in place, as without a cache
        return build_once(out_dir, marker_name, marker, write)
    return build_once(out_dir, marker_name, marker, _copy_files(cached, marker_name))
