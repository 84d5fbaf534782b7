"""What a training run takes besides its plan, and the one way those options travel as argv.

A multi-process run re-invokes `advisor train --launched` in every worker (trainer/launch.py), so the
options cross a process boundary as command-line flags. `train_argv` is the only place that writes
them; the train verb (advisor/cli/train.py) parses every one back. A field added here without a flag
there fails tests/test_cli_train.py instead of silently taking its default in the workers.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


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


def flag(name: str) -> str:
    """The `advisor train` flag of a TrainOptions field: `max_steps_per_stage` -> `--max-steps-per-stage`."""
    return "--" + name.replace("_", "-")


def train_argv(options: TrainOptions) -> list[str]:
    """`advisor train` flags that rebuild `options` exactly: every field, None ones left out (their
    flag's default is None), booleans as `--x` / `--no-x`."""
    argv: list[str] = []
    for f in fields(options):
        value = getattr(options, f.name)
        if isinstance(value, bool):
            argv.append(flag(f.name) if value else "--no-" + flag(f.name)[2:])
        elif value is not None:
            argv += [flag(f.name), str(value)]
    return argv
