"""Runs a plan as staged, task-split training (see the `train` issue); executes, never decides."""
