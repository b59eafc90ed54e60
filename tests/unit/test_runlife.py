"""colo.runlife's one table from exception to exit status and checkpoint policy (ENDINGS), and the context manager
that applies it to a whole launch. What each ending does to a real run (its checkpoint, its line, the processes it
stops) is the e2e tier's: tests/e2e/test_loop.py's failure runs, test_faults_*.py.

    .venv/bin/python -m pytest -q tests/unit/test_runlife.py
"""
from __future__ import annotations

import importlib
import io
import signal
from contextlib import redirect_stderr

import pytest

from colo import runlife
from colo.runlife import ENDINGS, NOTHING, SAVE, STOP_STATUS, Ending, RunLife, ending_of


def test_every_entry_names_an_exception_class() -> None:
    """The table names its exceptions (importing them would make a config error import torch and Ray): each name
    must be a class that exists, where it says, or its entry would never match."""
    for name in ENDINGS:
        module, _, cls = name.rpartition(".")
        found = getattr(importlib.import_module(module), cls)
        assert isinstance(found, type) and issubclass(found, BaseException), name
        assert f"{found.__module__}.{found.__qualname__}" == name, name  # defined there, not re-exported


def test_an_exception_ends_as_its_nearest_named_class() -> None:
    from colo.algo.rewards import RewardError
    from colo.cluster.actors import ActorDied
    from colo.config import ConfigError
    from colo.sync.plan import MappingError

    assert ending_of(ConfigError("x")).status == 2 and ending_of(ConfigError("x")).checkpoint == NOTHING
    assert ending_of(MappingError("x")).status == 2  # a ValueError: its own entry, not none
    assert ending_of(RewardError("x", "exact_match")) == Ending(1, SAVE)
    assert ending_of(FileNotFoundError("x")) is ENDINGS["builtins.OSError"]  # a subclass: its base's entry
    assert ending_of(KeyboardInterrupt()).status == STOP_STATUS and not ending_of(KeyboardInterrupt()).healthy
    assert not ending_of(ActorDied("engine DP rank 0")).healthy
    assert ending_of(ValueError("a bug")) is None  # not named: the traceback, the cluster not reused


def test_a_new_kind_of_failure_is_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    class PluginQuit(Exception):
        pass

    monkeypatch.setitem(ENDINGS, f"{__name__}.{PluginQuit.__qualname__}", Ending(2, NOTHING))
    assert ending_of(PluginQuit()).status == 2


def test_run_life_ends_a_refusal_a_stop_and_a_bug_as_the_table_says() -> None:
    """Before anything started: a ConfigError is one line and status 2, a stop signal is 130 (143 for SIGTERM) with
    one line, an exception the table does not name goes on up; the signal handlers are restored every time, and
    nothing of Ray is touched (no cluster was asked for)."""
    from colo.config import ConfigError

    before = signal.getsignal(signal.SIGINT)
    err = io.StringIO()
    with redirect_stderr(err), RunLife() as life:
        assert signal.getsignal(signal.SIGINT) != before  # the run's own handler meanwhile
        raise ConfigError("trainer.lr=-1 is out of range; fix: e.g. trainer.lr=1e-06")
    assert life.status == 2
    assert err.getvalue() == "colo: error: trainer.lr=-1 is out of range; fix: e.g. trainer.lr=1e-06\n"
    assert signal.getsignal(signal.SIGINT) == before
    err = io.StringIO()
    with redirect_stderr(err), RunLife() as life:
        life.stop._on_signal(signal.SIGTERM, None)  # what the handler does on a SIGTERM: KeyboardInterrupt
    assert life.status == 143 and err.getvalue() == "colo: stopped by SIGTERM\n"
    with pytest.raises(ZeroDivisionError), RunLife():
        1 / 0
    assert signal.getsignal(signal.SIGINT) == before
    with pytest.raises(ConfigError), RunLife(debug=True):  # --debug: the traceback instead of the line
        raise ConfigError("x")
    from colo.algo.rewards import RewardError

    with pytest.raises(RewardError), RunLife():  # a failure before the job exists: nothing to report into or save
        raise RewardError("x", "exact_match")


def test_run_life_imports_nothing_heavy() -> None:
    """The table and the context manager must not pull torch, Ray or vLLM into a config error (test_launch_cli.py
    checks the CLI; this names the module)."""
    import subprocess
    import sys

    code = ("import sys, colo.runlife; heavy = {'torch', 'ray', 'vllm', 'transformers'} & set(sys.modules); "
            "assert not heavy, heavy")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0
    assert runlife.RunLife.__exit__  # the context manager the launch runs in
