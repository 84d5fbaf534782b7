"""Staged training with a final mixed stage against one-pot training on the mixture, at equal tokens.

On the bundled curriculum (trainer/data/demo_corpus.py: language, arithmetic reasoning,
instructions, then a mixed stage replaying 30% language and 30% reasoning), demo-tiny trains twice
from the same initialisation, in one process on this CPU, with the same layout:

* **staged**: the demo task as it ships (per-stage learning rate re-warmed, reasoning easy ->
  hard), every stage's token budget and warm-up times --scale;
* **one-pot**: one stage of the same total tokens on the same mixture: each data file weighted by
  the tokens the staged run drew from it (the mixed stage's share included), shuffled together;
  the first stage's learning rate and (scaled) warm-up, cosine decay over the whole run.

Scores: eval loss (mean token cross-entropy, lower is better) on each skill's held-out eval file,
EVAL_SEQUENCES sequences each, after every stage of the staged run (read from its stage-end
checkpoints) and at the end of the one-pot run. Forgetting: how much a skill's loss rose during
the instruction stage; recovery: how much of that the mixed stage took back.

    python -m bench.curriculum [--scale 1.0] [--seed 0] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import write_section  # noqa: E402

EVAL_SEQUENCES = 64
SKILLS = {"language": "data/language_eval.jsonl", "reasoning": "data/arithmetic_eval.jsonl",
          "instructions": "data/instructions_eval.jsonl"}


def load_average() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def scaled_task(task_path: Path, scale: float):
    from presets import load_task

    task = load_task(str(task_path))
    # budgets and learning-rate warm-ups shrink together, or a short stage would be all warm-up
    stages = [s.model_copy(update={"tokens": int(s.tokens * scale),
                                   "warmup_steps": max(1, round(s.warmup_steps * scale))}) for s in task.stages]
    return task.model_copy(update={"stages": stages})


def one_pot_task(task, steps: int):
    """One stage of `steps` optimizer steps (the staged run's total: equal tokens), each source
    weighted by the tokens the staged run drew from it."""
    from advisor.task import DataSource

    total = sum(s.tokens for s in task.stages)
    weights: dict[str, tuple[DataSource, float]] = {}
    by_name = {s.name: s for s in task.stages}
    for stage in task.stages:
        own = 1.0 - sum(stage.replay.values())
        total_weight = sum(src.weight for src in stage.sources) or 1.0
        draws = [(src, stage, own * src.weight / total_weight) for src in stage.sources]
        for name, share in stage.replay.items():
            earlier = by_name[name]
            earlier_weight = sum(src.weight for src in earlier.sources) or 1.0
            draws += [(src, earlier, share * src.weight / earlier_weight) for src in earlier.sources]
        for src, _owner, share in draws:
            _, tokens = weights.get(src.path, (src, 0.0))
            weights[src.path] = (src, tokens + share * stage.tokens)
    sources = [src.model_copy(update={"weight": tokens / total}) for src, tokens in weights.values()]
    first = task.stages[0]
    stage = first.model_copy(update={"name": "one-pot", "sources": sources, "replay": {}, "tokens": None,
                                     "steps": steps, "eval_sources": [], "eval_tokens": 0})
    return task.model_copy(update={"stages": [stage]}), {p: t / total for p, (_, t) in weights.items()}


def make_plan_for(task):
    from planner.plan import PlanOptions, make_plan
    from planner.search import SearchSpace
    from presets import load_hardware, load_model

    # one process, micro-batches of at most 4 (faster here than one micro-batch of 16)
    return make_plan(PlanOptions(model=load_model("demo-tiny"), hardware=load_hardware("cpu"), gpus_per_node=1,
                                 task=task, space=SearchSpace(tp_degrees=(1,), pp_degrees=(1,), max_micro_batch=4)))


def train(plan, run_dir: Path, seed: int = 0) -> float:
    from trainer.loop import TrainOptions, train as run_loop

    started = time.perf_counter()
    run_loop(plan, run_dir, False, TrainOptions(seed=seed, keep_checkpoints=1000, show_progress=False))
    return time.perf_counter() - started


def evaluate(run_dir: Path, plan, task, steps: list[int]) -> list[dict[str, float]]:
    """Eval loss per skill at each of `steps` (stage-end checkpoints)."""
    import torch

    from advisor.task import DataSource
    from trainer.corpus import load_source, tokenizer_for
    from trainer.materialize import materialize, pending_init
    from trainer.model import build_model
    from trainer.loop import _evaluate
    from trainer.stream import Source

    tokenizer = tokenizer_for(task, plan.model.name, int(plan.model.hf_config["vocab_size"]))
    seq = plan.chosen.layout.seq
    sources = [Source(skill, load_source(DataSource(path=path), task, tokenizer, seq, run_dir / "data_cache"), 1.0)
               for skill, path in SKILLS.items()]
    model = build_model(plan.model, plan.chosen.layout.model_copy(update={"recompute": "none"}), 0)
    materialize(model, pending_init(model), torch.device("cpu"))  # built on the meta device: give it storage
    out = []
    for step in steps:
        state = torch.load(run_dir / "checkpoints" / f"step-{step:08d}" / "engine.pt", map_location="cpu",
                           weights_only=True)
        model.load_state_dict(state["model"])
        out.append(_evaluate(model, sources, EVAL_SEQUENCES, plan.chosen.layout.mbs, torch.device("cpu")))
    return out


def stage_end_steps(run_dir: Path) -> list[tuple[str, int]]:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [(e["stage"], e["step"]) for e in events if e["event"] == "stage_end"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every stage's token budget")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and data order of both runs")
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args()
    from trainer.data.demo_corpus import generate_demo_corpus

    work = Path(tempfile.mkdtemp(prefix="curriculum_"))
    task_path = generate_demo_corpus(work)["task.yaml"]
    staged_task = scaled_task(task_path, args.scale)
    loads = [load_average()]
    staged_plan = make_plan_for(staged_task)
    layout = staged_plan.chosen.layout
    pot_task, mixture = one_pot_task(staged_task, sum(s.steps for s in staged_plan.stages))
    pot_plan = make_plan_for(pot_task)
    if pot_plan.chosen.layout != layout:  # same model, batch and sequence: the planner agrees; if not, pin it
        from trainer.verify import candidate_plan

        pot_plan = candidate_plan(pot_plan, staged_plan.chosen)
    print(f"layout {layout.short()}; staged steps {[s.steps for s in staged_plan.stages]}, "
          f"one-pot steps {[s.steps for s in pot_plan.stages]}", flush=True)

    staged_s = train(staged_plan, work / "staged", args.seed)
    loads.append(load_average())
    ends = stage_end_steps(work / "staged")
    staged = evaluate(work / "staged", staged_plan, staged_task, [step for _, step in ends])
    print(f"staged: {staged_s:.0f} s; {staged}", flush=True)
    pot_s = train(pot_plan, work / "one-pot", args.seed)
    loads.append(load_average())
    pot_end = stage_end_steps(work / "one-pot")
    pot = evaluate(work / "one-pot", pot_plan, pot_task, [pot_end[-1][1]])[0]
    print(f"one-pot: {pot_s:.0f} s; {pot}", flush=True)

    tokens = sum(s.steps for s in staged_plan.stages) * layout.tokens_per_step
    pot_tokens = sum(s.steps for s in pot_plan.stages) * pot_plan.chosen.layout.tokens_per_step
    skills = list(SKILLS)
    rows = ["| run | after | step | " + " | ".join(f"{s} eval loss" for s in skills) + " | mean |",
            "|---|---|---|" + "---|" * (len(skills) + 1)]
    for (stage, step), losses in zip(ends, staged):
        rows.append(f"| staged | {stage} | {step} | " + " | ".join(f"{losses[s]:.3f}" for s in skills)
                    + f" | {sum(losses.values()) / len(losses):.3f} |")
    rows.append(f"| one-pot | all ({pot_end[-1][1]} steps) | {pot_end[-1][1]} | "
                + " | ".join(f"{pot[s]:.3f}" for s in skills) + f" | {sum(pot.values()) / len(pot):.3f} |")
    by_stage = dict(zip((stage for stage, _ in ends), staged))
    lines = []
    if {"reasoning", "instructions", "mixed"} <= set(by_stage):
        for skill in ("language", "reasoning"):
            before, after, end = (by_stage[s][skill] for s in ("reasoning", "instructions", "mixed"))
            forgot = after - before
            recovered = (after - end) / forgot if forgot > 0 else float("nan")
            lines.append(f"{skill}: {before:.3f} after the reasoning stage, {after:.3f} after instructions "
                         f"({forgot:+.3f} forgetting), {end:.3f} after mixed "
                         + (f"({100 * recovered:.0f}% of it recovered)" if forgot > 0 else "(no forgetting to recover)"))
    final = staged[-1]
    diffs = ", ".join(f"{s} {final[s] - pot[s]:+.3f}" for s in skills)
    summary = (
        "\n\nForgetting and recovery (staged run): " + "; ".join(lines) + ".\n\n"
        f"Staged minus one-pot at the end (negative: staged better): {diffs}. "
        f"Equal tokens: {tokens:,} staged, {pot_tokens:,} one-pot ({args.scale} x the demo's budgets), layout "
        f"{layout.short()}, 1 process on this CPU, seed {args.seed} for both. One-pot mixture by tokens drawn: "
        + ", ".join(f"{Path(p).stem} {100 * w:.0f}%" for p, w in mixture.items())
        + f". Eval: {EVAL_SEQUENCES} held-out sequences of {layout.seq} tokens per skill. Wall time: staged "
        f"{staged_s:.0f} s, one-pot {pot_s:.0f} s; 1-minute load average {', '.join(loads)} (2 cores, shared)."
    )
    body = "\n".join(rows) + summary
    print(body)
    if not args.no_write:
        write_section("curriculum", "Curriculum: staged with a final mixed stage against one-pot on the "
                      "mixture (demo-tiny, equal tokens)",
                      f"python -m bench.curriculum --scale {args.scale}" + (f" --seed {args.seed}" if args.seed else ""),
                      body)


if __name__ == "__main__":
    main()
