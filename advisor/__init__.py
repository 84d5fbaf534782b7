"""advisor: profile, plan, train and report task-split LLM training.

This package holds the CLI and the shared specs only; the logic lives in `profiler/`, `planner/`,
`trainer/` and `reports/`.
"""

__version__ = "0.1.0"
