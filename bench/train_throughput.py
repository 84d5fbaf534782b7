"""Tokens/s of advisor's training loop against a plain transformers + accelerate loop.

Both sides train the same model (built from its config with the same seed), on the same
micro-batches (the ones advisor's stage stream yields for the plan's layout), in one process, with
the same micro-batch size and accumulation, fp32 AdamW and gradient clipping at 1.0. The plain loop
is what one writes by hand with accelerate: `accumulate`, `backward`, `clip_grad_norm_`, `step`,
batches already in memory, no logging. Advisor's side is `trainer.loop.train` as `advisor train`
runs it: stage stream, spike guard, metrics.jsonl, TensorBoard, progress bar.

A step's time is the interval between two consecutive completed steps (for advisor: two
metrics.jsonl records), so every per-step cost of the loop counts. The two sides alternate in R
repeats of N steps; each repeat's median steady step (the first 2 warm up) is taken, then the
median over repeats. The machine is shared and noisy: trust the ratio of interleaved medians, not
one run.

    python -m bench.train_throughput [--model demo-tiny] [--steps 12] [--repeats 5] [--threads T] [--no-write]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

WARMUP = 2


def make_bench_plan(model: str, root: Path, steps: int):
    """A one-stage plan of `steps` steps for `model` on the demo curriculum, 1 process."""
    from planner.plan import PlanOptions, make_plan
    from presets import load_hardware, load_model, load_task
    from trainer.data.demo_corpus import generate_demo_corpus

    generate_demo_corpus(root, seed=0, scale=0.05)
    task = load_task(str(root / "task.yaml"))
    task = task.model_copy(update={"stages": task.stages[:1]})
    plan = make_plan(PlanOptions(model=load_model(model), hardware=load_hardware("cpu"), gpus_per_node=1,
                                 task=task, min_compute_fraction=0.0))
    stage = plan.stages[0]
    stage.steps, stage.checkpoint_every_steps = steps, steps + 1  # checkpoints only at start and end
    plan.stages = plan.stages[:1]
    return plan


def advisor_steps(plan, run_dir: Path) -> tuple[list[float], list[float]]:
    """Intervals between consecutive metrics.jsonl records of one advisor training run, and the
    part of each spent outside the engine's micro-steps and optimizer step (the loop's overhead)."""
    import trainer.loop as loop
    from specs.run_dir import JsonLines
    from trainer.engines.plain import PlainEngine

    stamps: list[float] = []
    inside = [0.0]
    engine_time: list[float] = []
    originals = (JsonLines.write, PlainEngine.micro_step, PlainEngine.optimizer_step)

    def timed(self, record):
        originals[0](self, record)
        if "loss" in record and "event" not in record:
            stamps.append(time.perf_counter())
            engine_time.append(inside[0])
            inside[0] = 0.0

    def clocked(method):
        def wrapper(self, *args):
            started = time.perf_counter()
            try:
                return method(self, *args)
            finally:
                inside[0] += time.perf_counter() - started
        return wrapper

    JsonLines.write, PlainEngine.micro_step, PlainEngine.optimizer_step = (
        timed, clocked(originals[1]), clocked(originals[2]))
    try:
        loop.train(plan, run_dir, resume=False, options=loop.TrainOptions(eval_sequences=1))
    finally:
        JsonLines.write, PlainEngine.micro_step, PlainEngine.optimizer_step = originals
    intervals = [b - a for a, b in zip(stamps, stamps[1:])]
    return intervals, [interval - engine for interval, engine in zip(intervals, engine_time[1:])]


def plain_steps(plan, batches: list[list[torch.Tensor]]) -> list[float]:
    """A minimal hand-written accelerate loop over the same micro-batches."""
    from accelerate import Accelerator
    from transformers import AutoConfig, AutoModelForCausalLM

    layout = plan.chosen.layout
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=layout.gas)
    torch.manual_seed(0)
    config = AutoConfig.for_model(**plan.model.hf_config)
    config.use_cache = False
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.task.stages[0].lr, weight_decay=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    times = [time.perf_counter()]
    for micro_batches in batches:
        for input_ids in micro_batches:
            with accelerator.accumulate(model):
                loss = model(input_ids=input_ids, labels=input_ids).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter())
    return [b - a for a, b in zip(times[1:], times[2:])]  # as advisor: intervals between step ends


def same_batches(plan, root: Path, steps: int) -> list[list[torch.Tensor]]:
    from trainer.corpus import stage_sources, tokenizer_for
    from trainer.stream import StageStream

    layout, task = plan.chosen.layout, plan.task
    tokenizer = tokenizer_for(task, plan.model.name, int(plan.model.hf_config["vocab_size"]))
    stream = StageStream(stage_sources(task, 0, tokenizer, layout.seq, root / "cache"), 0, 0)
    per_step = layout.dp * layout.mbs * layout.gas
    return [[torch.from_numpy(stream.global_batch(step * per_step, 1, layout.mbs, layout.gas, 0, micro))
             for micro in range(layout.gas)] for step in range(steps)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo-tiny")
    parser.add_argument("--steps", type=int, default=12, help="steps per repeat and side")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="bench-train-"))
    plan = make_bench_plan(args.model, root, args.steps)
    layout = plan.chosen.layout
    tokens_per_step = layout.tokens_per_step
    batches = same_batches(plan, root, args.steps)
    advisor_medians, plain_medians, overheads = [], [], []
    for repeat in range(args.repeats):
        if repeat % 2:  # alternate which side goes first: neither always inherits the other's heap and caches
            plain = plain_steps(plan, batches)[WARMUP - 1:]
        ours, overhead = (x[WARMUP - 1:] for x in advisor_steps(plan, root / f"run-{repeat}"))
        overheads.extend(overhead)
        if not repeat % 2:
            plain = plain_steps(plan, batches)[WARMUP - 1:]
        advisor_medians.append(statistics.median(ours))
        plain_medians.append(statistics.median(plain))
        print(f"repeat {repeat + 1}: advisor {advisor_medians[-1] * 1e3:.1f} ms/step, "
              f"plain {plain_medians[-1] * 1e3:.1f} ms/step", file=sys.stderr)
    advisor_s, plain_s = statistics.median(advisor_medians), statistics.median(plain_medians)
    # each repeat pairs two neighbouring segments: the median of paired ratios resists the load drifting
    ratio = statistics.median(p / a for a, p in zip(advisor_medians, plain_medians))
    rows = [("advisor train (trainer.loop)", advisor_s, advisor_medians),
            ("transformers + accelerate, hand-written", plain_s, plain_medians)]
    table = ["| loop | median step | tokens/s | per-repeat medians (ms) |", "|---|---:|---:|---|"]
    for name, step_s, medians in rows:
        table.append(f"| {name} | {step_s * 1e3:.1f} ms | {tokens_per_step / step_s:,.0f} | "
                     f"{', '.join(f'{m * 1e3:.1f}' for m in medians)} |")
    overhead = statistics.median(overheads)
    body = ("\n".join(table)
            + f"\n\nAdvisor's loop outside the engine calls (data, spike guard, all-reduce of the step's numbers, "
            f"metrics.jsonl, TensorBoard, progress bar): median {overhead * 1e3:.2f} ms per step "
            f"({100 * overhead / advisor_s:.2f}% of it).\n\n"
            f"Model {args.model}, layout `{layout.short()}` ({tokens_per_step:,} tokens per step), {args.repeats} "
            f"interleaved repeats of {args.steps} steps (the side that goes first alternates), medians after {WARMUP} "
            f"warm-up steps, {torch.get_num_threads()} threads. **Ratio advisor / plain tokens/s: {ratio:.3f}** "
            f"(median of the per-repeat ratios; goal >= 0.97; ratio of the medians {plain_s / advisor_s:.3f}). "
            "A shared machine: rerun on a quiet one before trusting small differences.\n")
    print(body)
    if not args.no_write:
        from bench.benchmarks_md import write_section

        command = "python -m bench.train_throughput " + shlex.join(argv if argv is not None else sys.argv[1:])
        write_section("train_throughput", "Training loop throughput: advisor against plain transformers + accelerate",
                      command.strip(), body)
    return {"advisor_step_s": advisor_s, "plain_step_s": plain_s, "ratio": ratio, "overhead_s": overhead}


if __name__ == "__main__":
    main()
