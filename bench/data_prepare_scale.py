"""`advisor data prepare` on every core: documents/s of the scan as datatrove tasks at 1 and 2
workers, against the single-process path, measured side by side in one run.

One generated corpus (bench/data_buckets.py's long-tailed paragraphs with planted exact and near
duplicates, one JSON-lines file). Three ways to prepare it, each in a fresh process, `--repeats`
times in turn (so that a slow spell of a shared machine hits all three alike); the median counts:

- single process: the whole file one part, read by `datasets` as before the scan was cut into
  parts, in the calling process (the path every prepare took until now);
- 1 worker: the file cut into parts of 10,000 rows, the tasks run one after another in-process,
  on one core (a worker encodes on one thread);
- 1 worker on one core: the same, pinned to one core (taskset): it must match 1 worker;
- 2 workers: the same parts on datatrove's pool of 2 processes.

All three must keep and drop the same documents (checked). CPU time is the prepare's and its
descendants' (user and system; on a shared machine a way's wall time can fall only as far as its
CPU time spread over the cores allows). Peak memory is ru_maxrss of the prepare's process and the
largest VmHWM of its descendants (pool workers, datatrove's manager and forkserver), sampled from
/proc every 0.2 s while it runs.

    python bench/data_prepare_scale.py [--documents 200000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

from benchmarks_md import write_section  # noqa: E402
from data_buckets import MICRO_BATCH_TOKENS, SEED, SEQ_LEN, write_corpus  # noqa: E402

CHILD = textwrap.dedent("""
    import json, os, resource, sys, threading, time
    from pathlib import Path
    from presets import load_task
    from trainer.data.prepare import prepare

    TICK = os.sysconf("SC_CLK_TCK")
    seen = {}  # pid -> (peak RSS KiB, CPU s): datatrove's workers are the forkserver's children,
               # which getrusage(RUSAGE_CHILDREN) of this process never counts, so /proc is sampled

    def descendants():
        parent = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(stat.parent.name)] = int(fields[1])
        found, frontier = set(), {os.getpid()}
        while frontier:
            frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
            found |= frontier
        return found

    def sample(stop):
        while not stop.wait(0.2):
            for pid in descendants():
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                hwm = next((int(l.split()[1]) for l in status.splitlines() if l.startswith("VmHWM:")), 0)
                seen[pid] = (hwm, (int(fields[11]) + int(fields[12])) / TICK)

    task = load_task(sys.argv[1])
    workers, rows_per_part = int(sys.argv[3]), int(sys.argv[4])
    stop = threading.Event()
    sampler = threading.Thread(target=sample, args=(stop,), daemon=True)
    sampler.start()
    started = time.perf_counter()
    out, manifest = prepare(task, sys.argv[2], workers=workers, rows_per_part=rows_per_part)
    seconds = time.perf_counter() - started
    stop.set()
    sampler.join()
    me = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"seconds": seconds, "peak_kib": me.ru_maxrss,
                      "worker_peak_kib": max((hwm for hwm, _ in seen.values()), default=0),
                      "children_peak_sum_kib": sum(hwm for hwm, _ in seen.values()),
                      "cpu_s": me.ru_utime + me.ru_stime + sum(cpu for _, cpu in seen.values())}))
""")

PART_ROWS = 10_000


ONE_CORE = "1 worker on one core"


def ways(documents: int) -> list[tuple[str, int, int]]:
    """(label, workers, rows per part). `ONE_CORE` is the 1-worker prepare pinned to one core
    (taskset): a worker encodes on one thread (`--workers N` uses N cores), so it must match the
    unpinned 1 worker; before that, the tokenizer's rayon pool spread a 1-worker prepare over every
    core, and 2 workers against it understated what a second worker adds."""
    return [("single process (whole file one part)", 1, documents + 1), ("1 worker", 1, PART_ROWS),
            (ONE_CORE, 1, PART_ROWS), ("2 workers", 2, PART_ROWS)]


def run_once(folder: Path, workers: int, rows_per_part: int, one_core: bool = False) -> dict:
    """One prepare in a fresh process (`one_core`: pinned to core 0); its figures and outcome."""
    out = folder / f"out-{workers}-{rows_per_part}"
    pinned = ["taskset", "-c", "0"] if one_core else []
    done = subprocess.run([*pinned, sys.executable, "-c", CHILD, str(folder / "task.yaml"), str(out), str(workers),
                           str(rows_per_part)], cwd=ROOT, check=True, capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    manifest = json.loads((out / "manifest.json").read_text())
    info = manifest["stages"][0]["train"]
    result["outcome"] = {"documents": info["documents"], "dropped": info["dropped"], "tokens": info["tokens"]}
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--documents", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in ways(args.documents)}
    with tempfile.TemporaryDirectory(prefix="advisor-bench-scale-") as tmp:
        folder = Path(tmp)
        truth = write_corpus(folder / "corpus.jsonl", args.documents, SEED)
        task = {"name": "bench", "model": "demo-tiny", "seq_len": SEQ_LEN,
                "data": {"buckets": {"micro_batch_tokens": MICRO_BATCH_TOKENS, "max_buckets": 8}},
                "stages": [{"name": "corpus", "tokens": 10**9, "sources": [{"path": "corpus.jsonl"}]}]}
        (folder / "task.yaml").write_text(yaml.safe_dump(task))
        for repeat in range(args.repeats):
            for label, workers, rows_per_part in ways(args.documents):
                run = run_once(folder, workers, rows_per_part, one_core=label == ONE_CORE)
                run["load"] = os.getloadavg()[0]  # the machine is shared: how busy it was
                runs[label].append(run)
                print(f"run {repeat + 1}: {label}: {run['seconds']:.1f} s, CPU {run['cpu_s']:.1f} s, "
                      f"load average {run['load']:.1f}", flush=True)
    outcomes = {json.dumps(r["outcome"], sort_keys=True) for rs in runs.values() for r in rs}
    assert len(outcomes) == 1, f"the ways kept or dropped different documents: {outcomes}"
    write_table(args, runs, truth)


def _loads(runs: dict[str, list[dict]]) -> str:
    loads = [r["load"] for rs in runs.values() for r in rs]
    return f"{min(loads):.1f} to {max(loads):.1f}"


def write_table(args: argparse.Namespace, runs: dict[str, list[dict]], truth: dict[str, int]) -> None:
    base = statistics.median(r["seconds"] for r in runs[ways(args.documents)[0][0]])
    one = statistics.median(r["seconds"] for r in runs["1 worker"])
    core = statistics.median(r["seconds"] for r in runs[ONE_CORE])
    lines = ["| way | median s | runs s | documents/s | vs single process | vs 1 worker | vs 1 worker on one core | "
             "CPU s (all processes) | peak RSS MiB (prepare / largest child) |", "|---|---|---|---|---|---|---|---|---|"]
    for label, rs in runs.items():
        median = statistics.median(r["seconds"] for r in rs)
        peak = max(r["peak_kib"] for r in rs) / 1024
        worker = max(r["worker_peak_kib"] for r in rs) / 1024
        each = ", ".join(f"{r['seconds']:.1f}" for r in rs)
        lines.append(f"| {label} | {median:.1f} | {each} | "
                     f"{args.documents / median:,.0f} | {base / median:.2f}x | {one / median:.2f}x | {core / median:.2f}x | "
                     f"{statistics.median(r['cpu_s'] for r in rs):.1f} | {peak:.0f} / {worker:.0f} |")
    outcome = next(iter(runs.values()))[0]["outcome"]
    dropped = outcome["dropped"]
    body = (f"Corpus: {args.documents:,} generated documents in one JSON-lines file (bench/data_buckets.py's "
            f"generator, seed {SEED}; planted truth {truth['exact']:,} exact / {truth['near']:,} near duplicates), "
            f"demo-tiny tokenizer, seq_len {SEQ_LEN}. Each way in a fresh process, {args.repeats} runs in turn, the "
            f"median counts; parts of {PART_ROWS:,} rows. Every way kept the same {outcome['documents']:,} documents "
            f"and dropped {dropped.get('exact_duplicate', 0):,} exact / {dropped.get('near_duplicate', 0):,} near "
            f"duplicates. Load average (1 min) after each run: {_loads(runs)} on {os.cpu_count()} cores.\n\n" +
            "\n".join(lines) +
            "\n\nThe scan (tokenise, quality numbers, hashes, MinHash signatures, grades) and datatrove's MinHash "
            "signature stage (its files from the scan's signatures) run on the workers, each on one core (the "
            "tokenizer encodes on the worker's thread); datatrove's MinHash buckets (one task per band), the pairs' "
            "verification and datatrove's clusters, the merge, duplicate resolution over the whole corpus, bucketing "
            "and shard writing stay in the prepare's process. "
            f"'{ONE_CORE}' is the 1-worker prepare pinned to core 0 (`taskset -c 0`): it checks that '1 worker' "
            "uses one core.")
    write_section("data_prepare_scale", "Data preparation on every core: scan tasks at 1 and 2 workers",
                  f"python bench/data_prepare_scale.py --documents {args.documents} --repeats {args.repeats}", body)


if __name__ == "__main__":
    main()
