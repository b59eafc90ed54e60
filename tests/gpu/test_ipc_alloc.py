"""CUDA IPC of colo's transfer buffers when the trainer process runs PyTorch's expandable segments.

    PYTHONPATH=. python -m pytest tests/gpu/test_ipc_alloc.py -q        (~20 s, one GPU)

Users set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for training memory. Memory from expandable
segments is mapped with the CUDA VMM API, and its IPC export differs from cudaIpcGetMemHandle's; colo's
SenderBuffers therefore allocate with expandable segments switched off (colo.sync.transport). Sender and
receiver are two fresh processes, as trainer and vLLM worker are; the receiver must read the sender's bytes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]

SENDER = """
import os, pickle, sys, time, torch
from colo.sync.transport import SenderBuffers
torch.cuda.set_device(0)
pad = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")  # the buffers are not the first allocation
sb = SenderBuffers(5 << 20, 2, "cuda:0")
for i, t in enumerate(sb.tensors):
    t.copy_((torch.arange(t.numel(), device=t.device) * (i + 3) % 251).to(torch.uint8))
torch.cuda.synchronize()
open(sys.argv[1] + ".tmp", "wb").write(pickle.dumps(sb.handles()))  # plain data, with the handle's bytes
os.replace(sys.argv[1] + ".tmp", sys.argv[1])  # the test polls for the name: it must appear complete
deadline = time.time() + 60
while not os.path.exists(sys.argv[2]) and time.time() < deadline:
    time.sleep(0.05)
"""

RECEIVER = """
import json, pickle, sys, torch
from colo.sync.transport import ReceiverBuffers
torch.cuda.set_device(0)
ok, handles = [], pickle.load(open(sys.argv[1], "rb"))
buffers = ReceiverBuffers("cuda:0")  # the receiver's own way in: each handle opened once
buffers.set_active(handles)
for h in handles:
    got = buffers.get(h["buffer_id"]).cpu()
    want = (torch.arange(h["nbytes"]) * (h["buffer_id"] + 3) % 251).to(torch.uint8)
    ok.append(bool(torch.equal(got, want)))
print(json.dumps({"ok": ok}))
"""


@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"])
def test_sender_buffers_cross_processes(tmp_path: Path, alloc_conf: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    handles, done = tmp_path / "handles.pkl", tmp_path / "done"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    sender = subprocess.Popen([sys.executable, "-c", SENDER, str(handles), str(done)],
                              env={**env, "PYTORCH_CUDA_ALLOC_CONF": alloc_conf} if alloc_conf else env,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not handles.exists() and sender.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert handles.exists(), f"sender failed: {sender.stderr.read() if sender.poll() is not None else 'timeout'}"
        rec = subprocess.run([sys.executable, "-c", RECEIVER, str(handles)], env=env, capture_output=True,
                             text=True, timeout=120)
        print(f"\n[gpu] ipc alloc_conf={alloc_conf!r}: rc={rec.returncode} {rec.stdout.strip()} "
              f"{rec.stderr.strip()[-400:]}")
        assert rec.returncode == 0, rec.stderr[-2000:]
        assert json.loads(rec.stdout.strip().splitlines()[-1])["ok"] == [True, True]
    finally:
        done.touch()
        sender.wait(timeout=60)
