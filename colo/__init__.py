"""colo: reinforcement learning on Mixture-of-Experts LMs with training and generation colocated.

Each GPU hosts one FSDP2 trainer rank and one vLLM engine rank (see docs/architecture.md); weights
move from trainer to engine over CUDA IPC (shared memory on CPU) after every update. Start with
`python -m colo.launch --help`. Importing this package stays cheap: no torch, Ray or vLLM here.
"""

__version__ = "0.1.0"
