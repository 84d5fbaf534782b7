"""Peak memory of `advisor data prepare` over a generated corpus of about 1 GB: it must stay under
2 GB, because the scan streams the text batch by batch and what grows with the corpus is only
about a hundred bytes per document (hashes, band keys, masks; see trainer/data/prepare.py).

The corpus is bench/data_buckets.py's generator (long-tailed paragraphs with planted exact and near
duplicates), written line by line to one JSON-lines file; its document count is chosen from a
20,000-document sample's bytes per document. One prepare at the default workers (every core), in
a fresh process; bench/data_prepare_scale.py's child measures it: the prepare process's peak RSS
(ru_maxrss) and each descendant's VmHWM (datatrove's pool workers, its manager and forkserver),
sampled every 0.2 s. The sum of all those peaks bounds what the prepare held at any one moment.

    python bench/data_prepare_memory.py [--gigabytes 1.0] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import write_section  # noqa: E402
from data_buckets import MICRO_BATCH_TOKENS, SEED, SEQ_LEN, write_corpus  # noqa: E402
from data_prepare_scale import PART_ROWS, run_once  # noqa: E402

LIMIT_BYTES = 2 * 10**9  # 2 GB, i.e. 1,907 MiB
SAMPLE_DOCUMENTS = 20_000


def documents_for(target_bytes: int, folder: Path) -> int:
    """Documents that make about `target_bytes` of JSON lines, from a sample of the same generator."""
    sample = folder / "sample.jsonl"
    write_corpus(sample, SAMPLE_DOCUMENTS, SEED)
    per_document = sample.stat().st_size / SAMPLE_DOCUMENTS
    sample.unlink()
    return int(target_bytes / per_document)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="advisor-bench-memory-") as tmp:
        folder = Path(tmp)
        documents = documents_for(int(args.gigabytes * 1e9), folder)
        started = time.perf_counter()
        truth = write_corpus(folder / "corpus.jsonl", documents, SEED)
        generated_s = time.perf_counter() - started
        size = (folder / "corpus.jsonl").stat().st_size
        task = {"name": "bench", "model": "demo-tiny", "seq_len": SEQ_LEN,
                "data": {"buckets": {"micro_batch_tokens": MICRO_BATCH_TOKENS, "max_buckets": 8}},
                "stages": [{"name": "corpus", "tokens": 10**12, "sources": [{"path": "corpus.jsonl"}]}]}
        (folder / "task.yaml").write_text(yaml.safe_dump(task))
        print(f"generated {size / 1e9:.2f} GB ({documents:,} documents) in {generated_s:.0f} s", flush=True)
        run = run_once(folder, args.workers, PART_ROWS)
    print(run, flush=True)
    write_table(args, documents, size, truth, run)


def write_table(args: argparse.Namespace, documents: int, size: int, truth: dict[str, int], run: dict) -> None:
    mib = 1024
    prepare, child, total = run["peak_kib"] / mib, run["worker_peak_kib"] / mib, \
        (run["peak_kib"] + run["children_peak_sum_kib"]) / mib
    outcome, dropped = run["outcome"], run["outcome"]["dropped"]
    verdict = "under" if total * 2**20 < LIMIT_BYTES else "OVER"
    body = (f"Corpus: {size / 1e9:.2f} GB, {documents:,} generated documents in one JSON-lines file "
            f"(bench/data_buckets.py's generator, seed {SEED}; planted truth {truth['exact']:,} exact / "
            f"{truth['near']:,} near duplicates), demo-tiny tokenizer, seq_len {SEQ_LEN}, parts of {PART_ROWS:,} "
            f"rows, {args.workers} workers, one prepare in a fresh process on a shared machine (wall time as "
            f"measured). It kept {outcome['documents']:,} documents ({outcome['tokens']:,} tokens) and dropped "
            f"{dropped.get('exact_duplicate', 0):,} exact / {dropped.get('near_duplicate', 0):,} near duplicates.\n\n"
            "| corpus GB | documents | wall s | CPU s (all processes) | peak RSS MiB: prepare | largest child | "
            "prepare + every descendant's peak | limit |\n|---|---|---|---|---|---|---|---|\n"
            f"| {size / 1e9:.2f} | {documents:,} | {run['seconds']:.0f} | {run['cpu_s']:.0f} | {prepare:.0f} | "
            f"{child:.0f} | {total:.0f} | {verdict} {LIMIT_BYTES / 1e9:.0f} GB ({LIMIT_BYTES / 2**20:,.0f} MiB) |")
    write_section("data_prepare_memory", "Data preparation memory on a 1 GB corpus",
                  f"python bench/data_prepare_memory.py --gigabytes {args.gigabytes} --workers {args.workers}", body)


if __name__ == "__main__":
    main()
