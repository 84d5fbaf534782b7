"""A plan made without `--task`, trained as one stage over `advisor train --data PATH`.

The launching process turns such a plan into an ordinary one-stage plan (a task whose single stage
reads PATH, sized here) and writes it into the run directory as the run's plan.yaml; the workers and
a later `--resume` then run it like any other plan, through the loop's one data path.

PATH is a file (a JSON array, JSON lines, parquet, arrow, CSV or text, told from its content), a
glob or folder of such files (told from their extensions), or a `datasets` `save_to_disk` folder,
read through the task's source as any task's raw data (trainer/data/sources.py; its row format,
trainer/data/formats.py, detected from the first rows' fields and written into the run's plan); or
an `advisor data prepare` folder (its train shards, all stages together, read
as length-bucketed micro-batches); or, with dataset names, LLaMA-Factory's `dataset_info.json`
(trainer/data/registry.py); or an Axolotl config whose `datasets:` the stage reads
(trainer/data/axolotl.py). Several datasets are concatenated or interleaved (`Reading.mix`,
trainer/data/mixing.py). The stage's length: `--steps`, else `--tokens` (rounded up to
whole optimizer steps of the plan's global batch), else one pass over the data: the tokens of the
full sequences PATH packs into at the plan's sequence length, or of the prepared train shards. Its
learning-rate schedule: the task's default, or `--lr-schedule` (`constant` lets a finished run be
extended with `--resume --steps` larger: trainer/schedule.py).
"""

from __future__ import annotations

import glob
import json
import math
from functools import partial
from pathlib import Path
from typing import Callable

from specs.errors import UsageError
from specs.plan_file import Plan
from specs.run_dir import DATA_CACHE_DIR
from specs.task import DataPrepSpec, DataSource, StageSpec, TaskSpec
from planner.granularity import restage
from trainer.corpus import load_source, source_format, tokenizer_for
from trainer.data.manifest import MANIFEST_NAME, read_manifest, task_fingerprint
from trainer.data.axolotl import axolotl_sources, is_axolotl_config
from trainer.data.mixing import Reading, mixture
from trainer.data.registry import REGISTRY_NAME, registry_sources
from trainer.data.sniff import is_saved_dataset
from trainer.data.sources import EXTENSIONS
from trainer.fine_tune import FineTuneFlags, fine_tune_task

FORMATS = ("jsonl", "parquet", "text", "arrow", "csv")
TASK_FILE_TYPES = ("jsonl", "parquet", "text", "arrow")  # what a task's `file_type` can name; others are detected
STAGE_NAME = "train"
CACHE = DATA_CACHE_DIR
PREPARED_VIEW = "prepared"  # the run dir's one-stage view of an `advisor data prepare` folder  # the run dir's cache of packed sequences, which the loop reads too (trainer/loop.py)


# (--weights folder, --template name, --trust-remote-code): what picks the tokenizer and its chat template (tokenizer_for)
TokenizerChoice = tuple[str | None, str | None, bool]


def data_format(path: str) -> str | None:
    """The source's file type for a folder or glob of one kind of file, from their extensions; None
    where the reader tells it from the content (a single file, a `save_to_disk` folder) or from
    the extensions itself (CSV files)."""
    given = Path(path)
    if given.is_file() or is_saved_dataset(given):
        return None
    if given.is_dir():
        files = [f for f in given.rglob("*") if f.is_file()]
    else:
        files = [Path(f) for f in glob.glob(path, recursive=True) if Path(f).is_file()]
    kinds = {fmt for f in files for fmt in FORMATS if f.name.endswith(EXTENSIONS[fmt])}
    if not kinds:
        raise UsageError(f"--data {path}: no {'/'.join(e for f in FORMATS for e in EXTENSIONS[f])} files there")
    if len(kinds) > 1:
        raise UsageError(f"--data {path} mixes {' and '.join(sorted(kinds))} files: point it at one kind")
    kind = kinds.pop()
    return kind if kind in TASK_FILE_TYPES else None


def one_stage_plan(plan: Plan, data: str, run_dir: Path, steps: int | None,
                   tokens: int | None, epochs: float | None = None,
                   weights: str | None = None, datasets: list[str] | None = None,
                   reading: Reading = Reading(), template: str | None = None,
                   lr_schedule: str | None = None, flags: FineTuneFlags = FineTuneFlags(),
                   trusted: bool = False) -> tuple[Plan, Path | None]:
    """`plan` with a one-stage task over `data`, sized by `steps`, `tokens`, `epochs` or one pass; and
    the prepared-data folder the loop reads (None: raw files, read through the task's sources).
    With `datasets`, `data` is LLaMA-Factory's `dataset_info.json` (or its folder) and the stage
    reads those datasets (trainer/data/registry.py); a YAML `data` is an Axolotl config. `weights` and
    `template` choose the tokenizer and its chat template as the loop does (`trainer.corpus.tokenizer_for`;
    `trusted`: --trust-remote-code).
    Its schedule, adapters and packing: `flags`, else fine-tuning's defaults from `weights`
    (trainer/fine_tune.py); `lr_schedule`, else the task's default."""
    if sum(budget is not None for budget in (steps, tokens, epochs)) > 1:
        raise UsageError("give one of --steps, --tokens or --epochs")
    layout = plan.chosen.layout
    settings = partial(fine_tune_task, layout=layout, weights=weights, flags=flags)
    prepared = Path(data) / MANIFEST_NAME
    if prepared.is_file():
        if flags.val_size is not None or not flags.packing:
            raise UsageError("--val-size and --no-packing read raw rows; prepared data was split and bucketed "
                             "by `advisor data prepare`")
        task = settings(_task(plan, [], steps=1, tokenizer=read_manifest(Path(data))["tokenizer"]["path"]))
        view, one_pass = _prepared_view(Path(data), task, run_dir)
    else:
        choice = (weights, template, trusted)
        (task, one_pass), view = _raw_task(plan, data, datasets, run_dir, choice, reading, settings), None
    if steps is None and tokens is None:
        one_pass = one_pass if one_pass is not None else _raw_tokens(plan, task, run_dir, (weights, template, trusted))
        tokens = one_pass
    if steps is None:
        steps = max(1, math.ceil(tokens / layout.tokens_per_step))  # type: ignore[operator]
    # an epochs budget: planned from one pass, sized exactly by the trainer from the rows it reads
    budget = {"steps": None, "epochs": epochs} if epochs is not None else {"steps": steps}
    stage = task.stages[0].model_copy(update=budget)
    task = task.model_copy(update={"stages": [stage], **({"lr_schedule": lr_schedule} if lr_schedule else {})})
    nodes = math.ceil(layout.devices / plan.gpus_per_node)
    planned = restage(plan, task, stage, layout, plan.chosen.estimate, nodes, one_pass_tokens=one_pass)
    return plan.model_copy(update={"task": task, "stages": [planned]}), view


def _raw_task(plan: Plan, data: str, datasets: list[str] | None, run_dir: Path, choice: TokenizerChoice,
              reading: Reading, settings: Callable[[TaskSpec], TaskSpec]) -> tuple[TaskSpec, int | None]:
    """The one-stage task over raw files: `data` itself, the registry's `datasets` or an Axolotl
    config's, each with its row format and loss switches fixed in the run's plan (the workers read
    it), with the fine-tune's `settings`. Several datasets mix as `reading.mix` says (concatenated by
    default, as LLaMA-Factory and Axolotl do), weighed from the sequences each packs into, which also
    gives one pass's tokens (None for one source, counted only when needed)."""
    sources = [_switched(s, reading) for s in _data_sources(data, datasets)]
    task = _task(plan, sources, steps=1)
    sources = [s.model_copy(update={"format": s.format or source_format(s, Path(task.base_dir))}) for s in sources]
    task = settings(_task(plan, sources, steps=1))
    if len(sources) == 1 and reading.mix_probs is None:
        return task, None
    counts = _sequences(plan, task, run_dir, choice)
    probs = list(reading.mix_probs) if reading.mix_probs is not None else None
    shares, sequences = mixture(reading.mix, probs, counts)
    total = sum(shares)  # as shares of 1: a weight stays within a task file's bounds however big the data
    task = settings(_task(plan, [s.model_copy(update={"weight": w / total}) for s, w in zip(sources, shares)], steps=1))
    return task, sequences * plan.chosen.layout.seq


def _data_sources(data: str, datasets: list[str] | None) -> list[DataSource]:
    """`--data`'s sources: the registry's named datasets, an Axolotl config's, or the path itself."""
    path = Path(data)
    if is_axolotl_config(path):
        if datasets:
            raise UsageError("--dataset names datasets of LLaMA-Factory's dataset_info.json; an Axolotl config "
                             "trains its whole `datasets:` list")
        return axolotl_sources(path)
    if datasets or path.name == REGISTRY_NAME:  # a registry without names: its reader lists them
        return registry_sources(path, datasets or [])
    return [DataSource(path=str(path.resolve()), file_type=data_format(data))]  # type: ignore[arg-type]


def _switched(source: DataSource, reading: Reading) -> DataSource:
    """The source with the flags' loss switches added to its own."""
    prompt, history = source.train_on_prompt or reading.train_on_prompt, source.mask_history or reading.mask_history
    if prompt and history:
        raise UsageError(f"{source.path}: --mask-history (train the last answer only) and train_on_prompt "
                         "(--train-on-prompt or Axolotl's train_on_inputs: every token) exclude each other")
    return source.model_copy(update={"train_on_prompt": prompt, "mask_history": history})


def _sequences(plan: Plan, task: TaskSpec, run_dir: Path, choice: TokenizerChoice) -> list[int]:
    """The full sequences each raw source packs into (the loop reads the same packed sequences from
    the run dir's cache); a source without one is refused."""
    layout = plan.chosen.layout
    tokenizer = tokenizer_for(task, plan.model.name, int(plan.model.hf_config.get("vocab_size", 0)), *choice)
    counts = []
    for source in task.stages[0].sources:
        counts.append(len(load_source(source, task, tokenizer, layout.seq, run_dir / CACHE)))
        if counts[-1] == 0:
            raise UsageError(f"--data {source.path}: not one full sequence of {layout.seq} tokens")
    return counts


def _raw_tokens(plan: Plan, task: TaskSpec, run_dir: Path, choice: TokenizerChoice) -> int:
    """Tokens of one pass over the raw sources: the full sequences they pack into."""
    return sum(_sequences(plan, task, run_dir, choice)) * plan.chosen.layout.seq


def _prepared_view(folder: Path, task: TaskSpec, run_dir: Path) -> tuple[Path, int]:
    """A manifest in the run dir whose one stage reads the train shards of every stage `advisor data
    prepare` wrote in `folder`, fingerprinted for the one-stage task (the loop checks it like any
    prepared folder); and the tokens of one pass over them. Rewritten only when it changes: the run's
    fingerprint stamps it, and a --resume must find it as it was."""
    manifest = read_manifest(folder)
    splits = [stage.get("train") or {} for stage in manifest["stages"]]
    shards = [{**s, "path": str((folder / s["path"]).resolve())} for split in splits for s in split.get("shards", [])]
    tokens = sum(int(split.get("tokens", 0)) for split in splits)
    if not tokens:
        raise UsageError(f"--data {folder}: the prepared data holds no training samples")
    view = {"version": manifest["version"], "task": task.name, "fingerprint": task_fingerprint(task),
            "seq_len": manifest["seq_len"], "micro_batch_tokens": manifest.get("micro_batch_tokens"),
            "tokenizer": manifest["tokenizer"], "prepared_from": str(folder.resolve()),
            "stages": [{"name": STAGE_NAME, "replay": {}, "train": {"shards": shards, "tokens": tokens},
                        "tokens": tokens, "tokens_with_replay": tokens}]}
    out = run_dir / PREPARED_VIEW
    text = json.dumps(view, indent=1) + "\n"
    path = out / MANIFEST_NAME
    if not path.is_file() or path.read_text() != text:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return out, tokens


def _task(plan: Plan, sources: list[DataSource], steps: int, tokenizer: str | None = None) -> TaskSpec:
    """The one-stage task: its sources (none for prepared data, which the loop reads from shards)."""
    layout = plan.chosen.layout
    base = Path(sources[0].path).parent if sources else Path.cwd()
    name = "+".join(Path(s.path).name for s in sources) or "prepared"
    return TaskSpec(name=f"data:{name}", model=plan.model.name,
                    seq_len=layout.seq, global_batch=layout.global_batch, base_dir=str(base),
                    data=DataPrepSpec(tokenizer=tokenizer),
                    stages=[StageSpec(name=STAGE_NAME, sources=sources, steps=steps)])
