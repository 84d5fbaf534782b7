"""advisor: profile, plan, train and report task-split LLM training.

This package holds what every layer shares: the specs (model, hardware, layout, estimate), the
structural layout rules (`layout_rules`), the file formats (`profile`, `plan_file`, `task`), the
errors, and the CLI: `advisor/cli/`, the one composition root and the only part of this package that
imports the layers above it (`presets` -> `profiler` -> `planner` -> `trainer` -> `reports`).
tests/test_layers.py checks that order.
"""

__version__ = "0.1.0"
