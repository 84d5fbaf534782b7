"""Executes a plan as staged, task-split training; decides nothing (the plan chose the layout).

- `prepare`: run-time preparation every caller does before launching (run-dir claim, a plan
  without a task made one stage, DeepSpeed's native op);
- `launch`: one process, or torchrun starting `trainer.worker` on one or many nodes, which reads the
  plan and options from the launch file (`launch_file`) the launcher writes into the run dir;
- `loop`: the staged curriculum (re-warm-up per stage, checkpoints, spike rollback, OOM fallback),
  reading top to bottom; `options` holds its options;
- `model` builds the Hugging Face model (recomputation, LoRA); `engines/` run it (one `Engine`
  contract: plain/DDP, DeepSpeed ZeRO, FSDP2/TP, pipeline); `parallelize` applies TP and FSDP;
- `checkpoint`, `spike`, `oom`, `schedule`, `stream`, `prepared`, `corpus`, `scalars`: one job each;
- `verify` times candidate layouts for `advisor run`; `timed_steps` runs real steps of a layout
  through the loop's own engine and step code, for the profiler's calibration, the verification
  trials and the benches;
- `data/`: `advisor data` (clean, grade, bucket, shard) and the demo corpus.
"""
