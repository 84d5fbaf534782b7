"""Length buckets and the cost of `advisor data prepare` on a generated long-tailed corpus.

For N and 2N documents (English-like paragraphs from the demo grammar, lognormal sentence counts,
so token lengths are long-tailed; 4% exact and 2% near duplicates planted), each size runs
`prepare` in a fresh process and records wall time and peak resident memory (ru_maxrss), with the
memory after imports as the baseline. Padding is reported three ways for the same micro-batch
token budget: the chosen buckets, one bucket (every sample padded to the longest), and random
micro-batches padded to their own longest sample (dynamic padding without buckets).

    python bench/data_buckets.py [--documents 200000]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

from benchmarks_md import write_section  # noqa: E402

from trainer.data.demo_corpus import sentence  # noqa: E402

SEQ_LEN = 1024
MICRO_BATCH_TOKENS = 8 * SEQ_LEN
SEED = 0

CHILD = textwrap.dedent("""
    import json, resource, sys, time
    from presets import load_task
    from trainer.data.prepare import prepare
    import datasets, tokenizers, pyarrow  # the imports every run pays, before the baseline
    try:
        import torch  # noqa: F401 - datasets' streaming imports it when installed
    except ImportError:
        pass
    task = load_task(sys.argv[1])
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    out, manifest = prepare(task)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"seconds": seconds, "peak_kib": peak, "baseline_kib": baseline, "out": str(out)}))
""")


def digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


def write_corpus(path: Path, documents: int, seed: int) -> dict[str, int]:
    """Long-tailed paragraphs; a few exact copies and one-word edits of earlier documents.

    Returns the truth to compare the drops with: documents whose case- and whitespace-folded text
    already appeared (exact: the planted copies and the grammar's own repeats of short paragraphs),
    and near: planted one-word edits plus documents whose words repeat an earlier document's with
    other punctuation (shingles are words, so their Jaccard similarity is 1)."""
    rng = random.Random(seed)
    kept: list[str] = []
    seen: set[bytes] = set()
    seen_words: set[bytes] = set()
    truth = {"exact": 0, "near": 0}
    with open(path, "w") as f:
        for _ in range(documents):
            roll = rng.random()
            near = False
            if kept and roll < 0.04:
                text = rng.choice(kept)
            elif kept and roll < 0.06:
                words = rng.choice(kept).split()
                near = len(words) >= 120  # one changed word in a long document: Jaccard >= 0.9
                if near:
                    words[len(words) // 2] = "zebra"
                text = " ".join(words)
            else:
                past = rng.random() < 0.5
                count = max(1, min(400, int(rng.lognormvariate(1.5, 1.0))))
                text = " ".join(sentence(rng, past) for _ in range(count))
                if len(kept) < 20000:
                    kept.append(text)
                elif rng.random() < 0.05:
                    kept[rng.randrange(len(kept))] = text
            folded = digest(" ".join(text.lower().split()))
            same_words = digest(" ".join(re.findall(r"\w+", text.lower())))
            if folded in seen:
                truth["exact"] += 1
            else:
                seen.add(folded)
                truth["near"] += near or same_words in seen_words  # e.g. the same sentence ending in "!"
            seen_words.add(same_words)
            f.write(json.dumps({"text": text}) + "\n")
    return truth


def run_prepare(folder: Path, documents: int) -> dict:
    truth = write_corpus(folder / "corpus.jsonl", documents, SEED)
    task = {"name": "bench", "model": "demo-tiny", "seq_len": SEQ_LEN,
            "data": {"buckets": {"micro_batch_tokens": MICRO_BATCH_TOKENS, "max_buckets": 8}},
            "stages": [{"name": "corpus", "tokens": 10**9, "sources": [{"path": "corpus.jsonl"}]}]}
    (folder / "task.yaml").write_text(yaml.safe_dump(task))
    done = subprocess.run([sys.executable, "-c", CHILD, str(folder / "task.yaml")], cwd=ROOT, check=True,
                          capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    manifest = json.loads((Path(result["out"]) / "manifest.json").read_text())
    return {**result, "truth": truth, "manifest": manifest}


def random_batch_padding(length_counts: list[list[int]], per_batch: int, seed: int = 0) -> float:
    """Padding of shuffled micro-batches of `per_batch` samples, each padded to its own longest."""
    lengths = np.repeat([lc[0] for lc in length_counts], [lc[1] for lc in length_counts])
    np.random.default_rng(seed).shuffle(lengths)
    usable = len(lengths) // per_batch * per_batch
    batches = lengths[:usable].reshape(-1, per_batch)
    return float(1 - batches.sum() / (batches.max(axis=1) * per_batch).sum())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--documents", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=1, help="runs per size; the fastest counts (shared machines)")
    args = parser.parse_args()
    sizes = [args.documents, 2 * args.documents]
    runs = []
    for documents in sizes:
        with tempfile.TemporaryDirectory(prefix="advisor-bench-data-") as tmp:
            started = time.perf_counter()
            tries = [run_prepare(Path(tmp), documents) for _ in range(args.repeats)]
            run = min(tries, key=lambda r: r["seconds"])
            run["peak_kib"] = max(r["peak_kib"] for r in tries)
            run["documents"] = documents
            runs.append(run)
            info = run["manifest"]["stages"][0]["train"]
            print(f"{documents:,} documents: prepare {run['seconds']:.1f} s, peak {run['peak_kib'] / 1024:.0f} MiB "
                  f"(after imports {run['baseline_kib'] / 1024:.0f} MiB), padding {info['padding']}, "
                  f"whole run {time.perf_counter() - started:.0f} s", flush=True)

    lines = ["| documents | kept | samples | tokens | dropped exact / near (truth) | prepare s | docs/s | "
             "peak RSS MiB | after imports MiB | growth MiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        info = run["manifest"]["stages"][0]["train"]
        dropped = info["dropped"]
        lines.append(
            f"| {run['documents']:,} | {info['documents']:,} | {info['samples']:,} | {info['tokens']:,} | "
            f"{dropped.get('exact_duplicate', 0):,} / {dropped.get('near_duplicate', 0):,} "
            f"({run['truth']['exact']:,} / {run['truth']['near']:,}) | {run['seconds']:.1f} | "
            f"{run['documents'] / run['seconds']:,.0f} | {run['peak_kib'] / 1024:.0f} | "
            f"{run['baseline_kib'] / 1024:.0f} | {(run['peak_kib'] - run['baseline_kib']) / 1024:.0f} |")
    per_doc = (runs[1]["peak_kib"] - runs[0]["peak_kib"]) * 1024 / (sizes[1] - sizes[0])
    first = runs[0]["manifest"]["stages"][0]["train"]
    per_batch_one = max(1, MICRO_BATCH_TOKENS // first["padding"]["one_bucket_edge"])
    dynamic = random_batch_padding(first["length_counts"], per_batch_one)
    pad = ["| buckets | edges | padding fraction | token slots |", "|---|---|---|---|",
           f"| chosen ({len(first['bucket_edges'])}) | {', '.join(map(str, first['bucket_edges']))} | "
           f"{100 * first['padding']['bucketed']:.1f}% | {first['padding']['slots_bucketed']:,} |",
           f"| one bucket | {first['padding']['one_bucket_edge']} | {100 * first['padding']['one_bucket']:.1f}% | "
           f"{first['padding']['slots_one_bucket']:,} |",
           f"| none: random micro-batches of {per_batch_one}, padded to their longest | - | {100 * dynamic:.1f}% | - |"]
    lengths = np.repeat([lc[0] for lc in first["length_counts"]], [lc[1] for lc in first["length_counts"]])
    body = (
        f"Corpus: {sizes[0]:,} generated documents (demo grammar, lognormal sentence counts: median "
        f"{int(np.median(lengths))} tokens, p90 {int(np.percentile(lengths, 90))}, p99 {int(np.percentile(lengths, 99))}, "
        f"max {int(lengths.max())} after cutting at seq_len {SEQ_LEN}), demo-tiny tokenizer, micro-batch budget "
        f"{MICRO_BATCH_TOKENS:,} tokens, at most 8 buckets.\n\n" + "\n".join(pad) +
        f"\n\nTime and memory of `prepare` (a fresh process per run; the fastest of {args.repeats} run(s) per size, "
        "the highest peak; peak = ru_maxrss; growth = peak minus the resident size after imports; 2 CPU cores):\n\n" + "\n".join(lines) +
        f"\n\nDoubling the corpus adds {per_doc:.0f} bytes of peak memory per added document: per-document "
        "hashes, one LSH band's keys at a time and selection masks. The text, the token ids and the MinHash "
        "signatures stream through in batches of 1,000 and spool to disk; the exact truth counts every repeat "
        "of the folded text, the grammar's own repeats of short paragraphs included.")
    write_section("data_buckets", "Data preparation: length buckets, time and memory (generated long-tailed corpus)",
                  f"python bench/data_buckets.py --documents {sizes[0]} --repeats {args.repeats}", body)


if __name__ == "__main__":
    main()
