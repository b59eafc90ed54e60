"""A checkpoint directory written whole or not at all, once: what colo.models.tiny and .families share.

    out = build_once(out_dir, "colo_preset.json", {"preset": "tiny", "seed": 0, ...}, write)

`write(tmp)` fills a sibling temp dir; the marker (the JSON given, written last) says what the directory
holds, so a second call with the same marker returns at once and a different marker rebuilds. Safe to race:
concurrent callers (test workers, engines on one host) each build in their own temp dir and move it into
place with one rename; a loser whose rename fails finds the winner's marker and returns. A directory that
holds something else is replaced file by file with the marker removed first and written last, so a reader
never sees a marker over mixed files.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


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
