"""Tools around colo that are not colo: answered experiments (tools/experiments/). Nothing in colo/ imports them
(tests/unit/test_import_graph.py); run them from the repository root, e.g. `python -m tools.experiments.fit`."""
