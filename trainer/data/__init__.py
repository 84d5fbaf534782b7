"""Data preparation for task-split training: clean, grade by difficulty, bucket by length, shard.

- `prepare.prepare(task)`: the whole `advisor data prepare` pipeline (streams; writes aside, then renames).
- `manifest.manifest_stage_tokens(task)`: tokens per stage from the prepared data (the CLI hands them to the planner).
- `shards.stage_shards(out, stage)` / `shards.load_shard(path)`: what `advisor train` reads.
- `demo_corpus.generate_demo_corpus(dir)` and `tokenizer.load_demo_tokenizer()`: the embedded demo's data.

Only `manifest` is imported here; it is light (no datasets, tokenizers or torch).
"""

from trainer.data.manifest import manifest_stage_tokens

__all__ = ["manifest_stage_tokens"]
