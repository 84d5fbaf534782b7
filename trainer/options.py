"""What a training run takes besides its plan.

A multi-process run's workers receive these options whole, in the launch file the launcher writes
(trainer/launch_file.py): a field added here reaches every rank without further code.
"""

from __future__ import annotations

from dataclasses import dataclass


# Set by the CLI's quiet console (advisor/cli/quiet.py) while it routes output: the file workers'
# output lands in, from which the launcher quotes a failed worker's error.
WORKER_LOG_ENV = "ADVISOR_WORKER_LOG"

@dataclass
class TrainOptions:
    seed: int = 0
    clip: float = 1.0
    keep_checkpoints: int = 3
    max_rollbacks: int = 3
    spike_lr_factor: float = 0.5  # the learning rate is multiplied by this after each rollback
    spike_warmup_steps: int = 20
    eval_sequences: int = 16
    max_steps_per_stage: int | None = None  # cap for demos and tests
    epochs: float | None = None  # every stage trains this many passes over its own data (overrides budgets)
    exact_match_prompts: int = 64  # held-out prompts per skill scored by greedy exact match (0: none)
    weights: str | None = None  # a local HF model folder to fine-tune instead of a random init
    template: str | None = None  # a built-in chat template (trainer/data/chat_templates.py) for chat rows
    merge: bool = False  # LoRA/QLoRA: the artifacts also hold the merged full weights (model/merged/)
    show_progress: bool = True
    data: str | None = None  # `advisor data prepare` folder; default: the task's data.out when fresh
    overwrite: bool = False  # a fresh start moves an old run in the run dir aside (else refuses it)
    timeout_s: float = 600.0  # process-group timeout: how long ranks wait for a dead peer
    trust_remote_code: bool = False  # the folders' own Python code (auto_map) may run (--trust-remote-code)

