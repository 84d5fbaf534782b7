"""`advisor train`: run a plan. The verb checks its flags, holds the run dir and routes output; the
trainer prepares the run (trainer/prepare.py) and launches its ranks (trainer/launch.py), whose
workers read their launch file (trainer/worker.py), never this verb."""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import typer

from advisor.cli import data_reading
from advisor.cli.common import TRUST_REMOTE_CODE, check_run_dir, console, exit_on_error
from advisor.cli.data import require_data_extra
from advisor.cli.progress import RunProgress, training_estimate_s
from advisor.cli.quiet import log_path, quiet_console
from advisor.cli.render import format_seconds, stage_results_lines
from specs.errors import UsageError
from specs.capabilities import config_shape, runnable_problem, ENGINE_CHOICES
from specs.plan_file import Plan, load_plan
from specs.run_dir import METRICS_FILE
from specs.remote_code import check_model_code, ensure_model_code, refuse_remote_code
from specs.core import check_number
from specs.task import LR_SCHEDULES, MAX_EPOCHS, MAX_ROWS
from profiler.cluster import cluster_options
from trainer.data.chat_templates import builtin_template
from trainer.data.demo_corpus import ensure_generated_data
from trainer.data.mixing import Reading
from trainer.fine_tune import FineTuneFlags, check_lora_rank
from trainer.options import TrainOptions
from trainer.prepare import OneStageRequest
from trainer.run_identity import restarted

DEFAULTS = TrainOptions()
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: a peer that long gone is not coming back


# A plan made without --task: its stage's schedule, adapters and data (trainer/fine_tune.py). Declared
# here, out of `train`'s signature, which the 80-line rule bounds.
FINE_TUNE_OPTIONS = {
    "lr": typer.Option(None, "--lr", help="a plan without a task: peak learning rate (default with --weights: "
                       "2e-4 for LoRA/QLoRA, 1e-5 for full; without: 3e-4)"),
    "warmup_ratio": typer.Option(None, "--warmup-ratio", help="a plan without a task: warm-up as a share of the "
                                 "run's steps as finally sized, then cosine decay to the end (default with "
                                 "--weights: 0.1; without: 20 steps)"),
    "lora_rank": typer.Option(None, "--lora-rank", min=1, help="the LoRA rank the plan priced (a check: another "
                              "rank is refused; set it with `advisor plan --lora-rank N`)"),
    "lora_alpha": typer.Option(None, "--lora-alpha", help="a plan without a task: LoRA alpha (default: twice the "
                               "rank)"),
    "lora_targets": typer.Option(None, "--lora-targets", help="a plan without a task: modules LoRA adapts, "
                                 "NAME[,NAME...] (default: every linear layer)"),
    "val_size": typer.Option(None, "--val-size", help="a plan without a task: rows of --data held out for the "
                             "evaluation loss and exact match, a count (>= 1) or a share (< 1), drawn by a fixed seed"),
    "packing": typer.Option(True, "--packing/--no-packing", help="a plan without a task: several examples share a "
                            "sequence (--no-packing: one example per sequence, padded)"),
}
OTHER_OPTIONS = {  # the same, for the verb's other long options
    "exact_match_prompts": typer.Option(DEFAULTS.exact_match_prompts, "--exact-match-prompts", min=0,
                                        help="held-out prompts per skill that each stage end answers by greedy "
                                        "decoding and scores by exact match (0: none)"),
    "dry_run": typer.Option(False, "--dry-run", help="check every stage's layout against this trainer on the meta "
                            "device (no devices, no data), show what each rank holds next to the cost model's "
                            "prediction, and exit: 0, or 2 with the reason"),
    "verbose": typer.Option(False, "--verbose", help="also show third-party warnings and logs (torch, DeepSpeed, "
                            "...) on the console; they always go to RUN_DIR/logs/"),
}


def train(
    plan_file: Path = typer.Argument(..., help="plan.yaml from `advisor plan ... --out plan.yaml` (with --task: "
                                     "its stages; without: one stage over --data)"),
    out: Path = typer.Option(Path("runs/latest"), "--out", help="run directory (metrics, events, checkpoints)"),
    resume: bool = typer.Option(False, "--resume", help="continue from the run directory's last checkpoint"),
    overwrite: bool = typer.Option(DEFAULTS.overwrite, "--overwrite/--no-overwrite",
                                   help="move a previous run in --out aside (into --out/previous-<time>/) "
                                   "instead of refusing to start over it"),
    timeout_s: float = typer.Option(DEFAULTS.timeout_s, "--timeout-s", min=1,
                                    help="seconds ranks wait for a dead or stuck peer before failing"),
    max_steps_per_stage: Optional[int] = typer.Option(None, "--max-steps-per-stage", min=1, help="cap (demos)"),
    seed: int = typer.Option(DEFAULTS.seed, "--seed"),
    weights: Optional[str] = typer.Option(None, "--weights", help="local HF model folder to start from"),
    template: Optional[str] = data_reading.OPTIONS["--template"],
    merge: bool = typer.Option(DEFAULTS.merge, "--merge/--no-merge", help="LoRA/QLoRA: also write the adapters "
                               "merged into full weights, RUN/model/merged/ (and per stage)"),
    data: Optional[Path] = data_reading.OPTIONS["--data"],
    dataset: Optional[str] = data_reading.OPTIONS["--dataset"],
    mix: str = data_reading.OPTIONS["--mix"],
    mix_probs: Optional[str] = data_reading.OPTIONS["--mix-probs"],
    train_on_prompt: bool = data_reading.OPTIONS["--train-on-prompt"],
    mask_history: bool = data_reading.OPTIONS["--mask-history"],
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="a plan without a task: optimizer steps of "
                                        "the plan's global batch (default: one pass over --data)"),
    tokens: Optional[int] = typer.Option(None, "--tokens", min=1, help="a plan without a task: tokens to train on, "
                                         "rounded up to whole steps (default: one pass over --data)"),
    lr_schedule: Optional[str] = typer.Option(None, "--lr-schedule", help="a plan without a task: rewarm_cosine "
                                              "(default: warm-up, cosine decay over the run), wsd or constant "
                                              "(warm-up, then the rate held: `--resume --steps` larger extends a "
                                              "finished run as if asked for from the start)"),
    epochs: Optional[float] = typer.Option(None, "--epochs", help="train every stage for this many passes "
                                           "over its own data (each example once per epoch, in a seeded order), "
                                           "instead of the budgets its task or --steps/--tokens give"),
    lr: Optional[float] = FINE_TUNE_OPTIONS["lr"],
    warmup_ratio: Optional[float] = FINE_TUNE_OPTIONS["warmup_ratio"],
    lora_rank: Optional[int] = FINE_TUNE_OPTIONS["lora_rank"],
    lora_alpha: Optional[float] = FINE_TUNE_OPTIONS["lora_alpha"],
    lora_targets: Optional[str] = FINE_TUNE_OPTIONS["lora_targets"],
    val_size: Optional[float] = FINE_TUNE_OPTIONS["val_size"],
    packing: bool = FINE_TUNE_OPTIONS["packing"],
    nnodes: Optional[int] = typer.Option(None, "--nnodes", min=1, help="nodes (default: Slurm's, else 1)"),
    node_rank: int = typer.Option(0, "--node-rank", min=0),
    master_addr: str = typer.Option("127.0.0.1", "--master-addr"),
    master_port: int = typer.Option(29513, "--master-port"),
    engine: Optional[str] = typer.Option(None, "--engine", help="sharded data-parallel back-end: auto (DeepSpeed "
                                         "for ZeRO, FSDP2 with tp>1), deepspeed or fsdp2; overrides the plan's"),
    # The loop's other options: hidden, for tests and demos that tune the loop.
    clip: float = typer.Option(DEFAULTS.clip, "--clip", hidden=True, help="gradient-norm clip"),
    keep_checkpoints: int = typer.Option(DEFAULTS.keep_checkpoints, "--keep-checkpoints", min=1, hidden=True),
    max_rollbacks: int = typer.Option(DEFAULTS.max_rollbacks, "--max-rollbacks", min=0, hidden=True),
    spike_lr_factor: float = typer.Option(DEFAULTS.spike_lr_factor, "--spike-lr-factor", hidden=True),
    spike_warmup_steps: int = typer.Option(DEFAULTS.spike_warmup_steps, "--spike-warmup-steps", min=0, hidden=True),
    eval_sequences: int = typer.Option(DEFAULTS.eval_sequences, "--eval-sequences", min=0, hidden=True),
    exact_match_prompts: int = OTHER_OPTIONS["exact_match_prompts"],
    show_progress: bool = typer.Option(DEFAULTS.show_progress, "--show-progress/--no-show-progress", hidden=True),
    dry_run: bool = OTHER_OPTIONS["dry_run"],
    as_json: bool = typer.Option(False, "--json", help="with --dry-run: print one JSON object"),
    verbose: bool = OTHER_OPTIONS["verbose"],
    trust_remote_code: bool = TRUST_REMOTE_CODE,
) -> None:
    """Run a plan as staged, task-split training: per-stage learning-rate re-warm-up, a checkpoint at
    every stage end and on the planned cadence, loss-spike rollback, exact --resume."""
    args = SimpleNamespace(**locals())
    exit_on_error(lambda: _check_inputs(args))
    if as_json and not dry_run:
        exit_on_error(_json_needs_dry_run)
    if dry_run:
        return _dry_run(plan_file, engine, as_json, verbose, trust_remote_code)
    summary = _launch(args)
    if summary:
        for line in stage_results_lines(summary):
            console.print(line, highlight=False, soft_wrap=True)
        measured, predicted = summary["measured"], summary["predicted"]
        console.print(f"trained {summary['steps']} steps ({summary['rollbacks']} rollbacks); step "
                      f"{format_seconds(measured['step_s'] or 0)} measured vs "
                      f"{format_seconds(predicted['step_s'])} predicted; run dir {out}; third-party output in "
                      f"{log_path(out)}")


def _launch(a: SimpleNamespace) -> dict | None:
    """The launching CLI's run: one launch per run dir (its lock held throughout), workers' and
    third-party output routed to the run's logs."""
    from trainer.run_lock import RunDirLock  # deferred: the trainer package, only for a launch

    lock = exit_on_error(lambda: RunDirLock.take(a.out, _node_rank(a)))
    try:
        with quiet_console(a.out, a.verbose):
            return exit_on_error(lambda: _run(a))
    finally:
        lock.release()


def _node_rank(a: SimpleNamespace) -> int:
    """This node's rank: --node-rank, or under Slurm without --nnodes, Slurm's (as the launcher reads it),
    so that each node of a Slurm job locks its own file in a shared run dir."""
    from profiler.slurm import slurm_topology  # deferred: the profiler package, only for a launch

    topology = slurm_topology() if a.nnodes is None else None
    return topology[1] if topology else a.node_rank


def _check_inputs(a: SimpleNamespace) -> None:
    """The float flags (typer's `min` lets `inf` and `nan` through), --out and the plan file, before
    anything is written: a refused run leaves no logs/ in --out."""
    check_number(a.epochs, "--epochs", gt=0, le=MAX_EPOCHS)
    check_number(a.timeout_s, "--timeout-s", ge=1, le=MAX_TIMEOUT_S)
    check_number(a.clip, "--clip", gt=0, le=1e6)
    check_number(a.spike_lr_factor, "--spike-lr-factor", gt=0, le=1)
    data_reading.reading(a)
    if a.template is not None:
        builtin_template(a.template)
    if a.lr_schedule is not None and a.lr_schedule not in LR_SCHEDULES:
        raise UsageError(f"--lr-schedule {a.lr_schedule}: choose {', '.join(LR_SCHEDULES)}")
    check_number(a.lr, "--lr", gt=0, le=1)
    check_number(a.warmup_ratio, "--warmup-ratio", ge=0, le=0.99)
    check_number(a.lora_alpha, "--lora-alpha", gt=0, le=1e6)
    check_number(a.val_size, "--val-size", gt=0, le=MAX_ROWS)
    if not a.dry_run:
        check_run_dir(a.out)
        plan = load_plan(a.plan_file)  # read again by the run: milliseconds
        # the folders' own code refused before anything is written (the run loads it, with the opt-in)
        check_model_code(plan.model.hf_config, plan.model.source, a.trust_remote_code,
                         "the plan's model")
        if a.weights:
            refuse_remote_code(Path(a.weights), "config.json", "--weights", a.trust_remote_code)
        for _, layout in plan.stage_layouts():
            check_lora_rank(layout, a.lora_rank)
        if plan.task is None:
            _fine_tune_flags(a)
        else:
            _refuse_one_stage_flags(a)
        # the nodes' flags checked as `advisor profile` checks them, before anything starts
        cluster_options(a.nnodes, a.node_rank, a.master_addr, a.master_port, a.timeout_s)


def _json_needs_dry_run() -> None:
    raise UsageError("--json goes with --dry-run (a training run writes its results to the run directory)")


def _dry_run(plan_file: Path, engine: str | None, as_json: bool, verbose: bool, trusted: bool) -> None:
    # deferred: the meta model needs torch and transformers (seconds), only for --dry-run
    from advisor.cli.dry_run import run_dry

    # third-party warnings of the model build are dropped with the scratch folder: no run dir is made
    with tempfile.TemporaryDirectory() as scratch, quiet_console(Path(scratch), verbose) as terminal:
        exit_on_error(lambda: run_dry(_with_model_code(_runnable(load_plan(plan_file), engine), trusted), as_json,
                                      terminal))


def _with_model_code(plan: Plan, trusted: bool) -> Plan:
    """The plan, its model's own Python code (a folder's auto_map) loaded with --trust-remote-code, else
    refused in one line: the run builds that model from its config."""
    ensure_model_code(plan.model.hf_config, plan.model.source, trusted, "the plan's model")
    return plan


def _run(a: SimpleNamespace) -> dict | None:
    """Prepare the run (trainer/prepare.py) and launch the plan; the summary."""
    # deferred: import torch/deepspeed (2.3 s), inside the quiet console so that their warnings are logged
    from trainer.launch import run
    from trainer.prepare import prepare_run

    plan = _with_model_code(_load_plan(a.plan_file, a.engine, a.data), a.trust_remote_code)
    resumed = a.resume or restarted()  # a torchrun restart or Slurm requeue continues the run
    prepared = prepare_run(plan, a.out, resumed=resumed, overwrite=a.overwrite, node_rank=a.node_rank, data=a.data,
                           one_stage=_one_stage_request(a) if plan.task is None else None, say=_say)
    plan = prepared.plan
    options = TrainOptions(seed=a.seed, clip=a.clip, keep_checkpoints=a.keep_checkpoints,
                           max_rollbacks=a.max_rollbacks, spike_lr_factor=a.spike_lr_factor,
                           spike_warmup_steps=a.spike_warmup_steps, eval_sequences=a.eval_sequences,
                           max_steps_per_stage=a.max_steps_per_stage, weights=a.weights, template=a.template,
                           merge=a.merge, epochs=a.epochs, exact_match_prompts=a.exact_match_prompts,
                           show_progress=False,  # one display, drawn here from metrics.jsonl: the loop draws none
                           data=str(prepared.data.resolve()) if prepared.data else None, overwrite=a.overwrite,
                           timeout_s=a.timeout_s, trust_remote_code=a.trust_remote_code)
    with RunProgress(console, a.show_progress, "advisor train") as progress:
        progress.expect(training_estimate_s(plan, a.max_steps_per_stage))
        with progress.training(plan, a.max_steps_per_stage, a.out / METRICS_FILE):
            return run(plan, a.out, resumed, options, a.nnodes, a.node_rank, a.master_addr, a.master_port)


def _say(text: str) -> None:
    console.print(text, highlight=False)


def _one_stage_request(a: SimpleNamespace) -> OneStageRequest:
    """The flags that make a plan without a task one stage over --data."""
    names = [n.strip() for n in a.dataset.split(",") if n.strip()] if a.dataset is not None else None
    if a.dataset is not None and not names:
        raise UsageError("--dataset: name at least one dataset of the registry")
    return OneStageRequest(a.data, a.steps, a.tokens, a.epochs, a.weights, names, data_reading.reading(a),
                           a.template, a.lr_schedule, _fine_tune_flags(a), a.trust_remote_code)


def _fine_tune_flags(a: SimpleNamespace) -> FineTuneFlags:
    targets = [name.strip() for name in a.lora_targets.split(",") if name.strip()] if a.lora_targets else None
    if a.val_size is not None and a.val_size >= 1 and a.val_size != int(a.val_size):
        raise UsageError(f"--val-size {a.val_size:g}: a count of rows is a whole number (a share is < 1)")
    if a.lora_targets is not None and not targets:
        raise UsageError("--lora-targets: name at least one module, e.g. q_proj,v_proj")
    return FineTuneFlags(lr=a.lr, warmup_ratio=a.warmup_ratio, lora_rank=a.lora_rank, lora_alpha=a.lora_alpha,
                         lora_targets=targets, val_size=a.val_size, packing=a.packing)


def _refuse_one_stage_flags(a: SimpleNamespace) -> None:
    """The flags that set a plan-without-task's stage: a task says these itself, per stage."""
    if a.steps is not None or a.tokens is not None:
        raise UsageError("--steps and --tokens size a plan made without --task; this plan's task sizes "
                         "its stages")
    if data_reading.reading(a) != Reading():
        raise UsageError("--mix, --mix-probs, --train-on-prompt and --mask-history read the --data of a plan "
                         "made without --task; a task's sources set weight, train_on_prompt and mask_history")
    if a.lr_schedule is not None:
        raise UsageError("--lr-schedule sets the schedule of a plan made without --task; this plan's task "
                         "sets its own (its lr_schedule)")
    given = [flag for flag, value in (("--lr", a.lr), ("--warmup-ratio", a.warmup_ratio),
                                      ("--lora-alpha", a.lora_alpha), ("--lora-targets", a.lora_targets),
                                      ("--val-size", a.val_size), ("--no-packing", None if a.packing else True))
             if value is not None]
    if given:
        raise UsageError(f"{', '.join(given)} set a plan made without --task; this plan's task file sets them "
                         "(stage lr and warmup_ratio, adapter alpha and targets, eval_sources, packing)")


def _load_plan(plan_file: Path, engine: str | None, data: Path | None) -> Plan:
    """The plan to run: its task's generated data in place, the `data` extra present for prepared
    shards, and --engine applied."""
    plan = _runnable(load_plan(plan_file), engine)
    if plan.task is not None and ensure_generated_data(plan.task):
        console.print(f"generated the {plan.task.name} task's data into {plan.task.base_dir}")
    if data is not None and plan.task is not None:
        require_data_extra("advisor train --data (prepared shards)")
    return plan


def _runnable(plan: Plan, engine: str | None) -> Plan:
    """--engine applied; a plan made with --any-engine refused unless each of its layouts runs here."""
    if engine is not None:
        if engine not in ENGINE_CHOICES:
            raise UsageError(f"--engine {engine}: choose {', '.join(ENGINE_CHOICES)}")
        plan = plan.model_copy(update={"engine": engine})
    if not plan.runnable_here:
        shape = config_shape(plan.model.hf_config)
        for name, layout in plan.stage_layouts():
            problem = runnable_problem(layout, shape, plan.hardware.device_type, plan.engine)
            if problem:
                raise UsageError(f"this plan was made with --any-engine, for other engines: advisor train does "
                                 f"not run {'stage ' + name if name else 'its layout'} {layout.short()}: {problem}")
    return plan
