"""specs: the bottom layer, what every other layer shares and imports nothing of the project's above it.

- `core`: the model, hardware, layout and estimate models, and how a user's YAML is read and validated.
- `capabilities`, `engine_traits`, `layout_rules`: which engine runs which feature, how each engine holds
  state and what it communicates, the structural rules a layout must meet; read by planner and trainer alike.
- `profile`, `plan_file`, `task`: the file formats the verbs write and read; `run_dir`: the run directory's
  files, its JSON-lines reader and writer, its typed events and summary.json's per-segment figures.
- `environment`: every environment variable the project reads, with its meaning.
- `errors`, `model_depth`, `remote_code`: one-line user errors, a model's depth, the --trust-remote-code gate.

The layers above, in order: `presets` -> `profiler` -> `planner` -> `trainer` -> `reports` -> `advisor`
(the CLI verbs and the compositions). tests/test_layers.py checks that order.
"""
