"""Executes a plan as staged, task-split training; decides nothing (the plan chose the layout).

- `launch`: one process, or torchrun re-invoking `advisor train --launched` on one or many nodes;
- `loop`: the staged curriculum (re-warm-up per stage, checkpoints, spike rollback, OOM fallback),
  reading top to bottom; `options` holds its options and the one conversion to worker argv;
- `model` builds the Hugging Face model (recomputation, LoRA); `engines/` run it (one `Engine`
  contract: plain/DDP, DeepSpeed ZeRO, FSDP2/TP, pipeline); `parallelize` applies TP and FSDP;
- `checkpoint`, `spike`, `oom`, `schedule`, `stream`, `prepared`, `corpus`, `scalars`: one job each;
- `verify` times candidate layouts for `advisor run`; `steps` is the step harness that the profiler's
  calibration and the benches run (the trainer's own model and engines);
- `data/`: `advisor data` (clean, grade, bucket, shard) and the demo corpus.
"""
