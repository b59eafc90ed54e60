"""Environments that answer the model: multi-turn, tool-using rollouts (docs/environments.md).

    base.py      Environment, Turn, Step, load_environment("calculator" | "python" | "module:Class")
    framing.py   ChatFraming: a conversation's token ids, each observation tokenized once with the chat
                 template's role framing (never a decode and re-encode of the history); Conversation
    runner.py    EnvRunner: one environment per conversation, each call under algo.env_timeout_s, its
                 answer checked; a bad environment ends its sample with an error, not the run
    calculator.py  the built-in "calculator" environment (arithmetic in a <tool_call>)
    sandbox.py   run_python(code, timeout, memory): model-written code in a sandbox; the "python" environment
    isolation.py the sandbox's walls: bubblewrap's namespaces, a cgroup per call, what a machine lacks
    offdriver.py EnvWorker: the environment code the driver needs (length check, demonstrations), in a process
                 of its own
"""
