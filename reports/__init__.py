"""Shows, never decides: the capacity report (before a run: time, GPU-hours, cost, scaling per option,
every figure from the planner) and the run report (after: predicted against measured, loss and
learning rate per stage, spikes, checkpoints, evaluation), each as self-contained HTML plus a
Markdown twin and PNG charts (`document`, `charts`, `pages`, `capacity`, `run_report`).
"""
