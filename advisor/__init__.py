"""advisor: profile, plan, train and report task-split LLM training.

This package holds what every layer shares: the specs (model, hardware, layout, estimate), the
structural layout rules, the file formats (profile, plan and task files), the errors, and the CLI,
the one composition root (`advisor/cli.py`, the only module here that imports the layers above:
`presets`, `profiler`, `planner`, `trainer`, `reports`).
"""

__version__ = "0.1.0"
