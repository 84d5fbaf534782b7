"""The curriculum bench's finished runs, kept in the repository so that the bench goes on across machines.

`advisor curriculum compare` reuses a run its --out already holds, finished with the same fingerprint
(trainer/run_reuse.py: the task, model, data and tokenizer by content, seed, layout, lengths and
scoring). A full comparison trains for hours, more than one session of a machine that starts empty
each time, so the bench keeps each finished run's record here, small enough to commit:

    bench/results/<name>/<variant>/lr-<rate>/seed-<n>/   (the run dir <out>/runs/<variant>/lr-<rate>/seed-<n>)
        run.json, summary.json, plan.yaml   (as the trainer wrote them)
        metrics.jsonl.gz                    (step and training loss: what the comparison reads of it)
        wall.json                           (the run's wall time, as the comparison measured it)

`restore` writes them back into a fresh --out before the comparison starts; its fingerprint check
then decides, as for any run dir, whether a record is the run asked for (a changed input trains
again). `keep_finished` copies each run the comparison finishes, while it runs, so that a stopped
bench loses at most the runs in flight.

Written by hand, not a library's: no tool of the field keeps finished training runs by fingerprint.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import threading
from pathlib import Path

from reports.curriculum import earlier_walls, recorded_wall_s
from specs.run_dir import METRICS_FILE, PLAN_FILE, RUN_FILE, SUMMARY_FILE, read_json_lines

KEPT = (RUN_FILE, SUMMARY_FILE, PLAN_FILE)
METRICS_KEPT = METRICS_FILE + ".gz"
WALL_FILE = "wall.json"
RUNS = "runs"


def finished(run_dir: Path) -> bool:
    """Whether its summary says the run finished (the comparison's own test)."""
    from trainer.run_reuse import finished as summary_finished  # deferred: the trainer imports torch (seconds)

    return summary_finished(run_dir)


def finished_runs(out: Path) -> list[Path]:
    """The run dirs under `out`/runs/<variant>/<rate>/<seed> whose summary says they finished."""
    return [summary.parent for summary in sorted((out / RUNS).glob(f"*/*/*/{SUMMARY_FILE}"))
            if finished(summary.parent)]


def keep(run_dir: Path, out: Path, archive: Path, walls: dict[str, float]) -> bool:
    """Copy one finished run's record into `archive` (whole or not at all); False when it was there."""
    target = archive / run_dir.relative_to(out / RUNS)
    if (target / WALL_FILE).is_file():
        return False
    run_id = json.loads((run_dir / RUN_FILE).read_text()).get("run_id")
    # as the comparison recorded it; one it has not recorded yet (parallel runs are recorded in order):
    # from its file times
    wall_s = recorded_wall_s(run_dir, walls)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for name in KEPT:
        shutil.copy2(run_dir / name, partial / name)
    losses = [{"step": m.get("step"), "loss": m["loss"]} for m in read_json_lines(run_dir / METRICS_FILE).records
              if "loss" in m]
    text = "".join(json.dumps(m) + "\n" for m in losses).encode()
    with open(partial / METRICS_KEPT, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write(text)  # mtime 0: the same run gives the same bytes, whenever kept
    (partial / WALL_FILE).write_text(json.dumps({"run_id": run_id, "wall_s": wall_s}) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return True


def keep_all(out: Path, archive: Path) -> int:
    """Keep every finished run of `out` not yet in `archive`; how many were new."""
    walls = earlier_walls(out)
    return sum(keep(run_dir, out, archive, walls) for run_dir in finished_runs(out))


def restore(archive: Path, out: Path) -> int:
    """Write the archive's runs into `out` where `out` holds no finished run there; how many. The
    comparison's fingerprint check then reuses each one that is the run it asks for. Each restored
    run's summary.json gets its measured end time (run.json's start plus its wall time), from which
    the comparison reads the wall time of a run no compare.json of this --out recorded."""
    import datetime as dt

    restored = 0
    for wall_file in sorted(archive.glob(f"*/*/*/{WALL_FILE}")):
        record, target = wall_file.parent, out / RUNS / wall_file.parent.relative_to(archive)
        if finished(target):
            continue
        if target.exists():  # an unfinished run of this --out: aside, never deleted
            target.rename(target.with_name(f"{target.name}.old-{os.getpid()}"))
        target.mkdir(parents=True)
        for name in KEPT:
            shutil.copy2(record / name, target / name)
        with gzip.open(record / METRICS_KEPT, "rt", encoding="utf-8") as f:
            (target / METRICS_FILE).write_text(f.read())
        wall_s = json.loads(wall_file.read_text())["wall_s"]
        started = dt.datetime.fromisoformat(json.loads((target / RUN_FILE).read_text())["created"]).timestamp()
        os.utime(target / SUMMARY_FILE, (started + wall_s, started + wall_s))
        restored += 1
    return restored


class Keeper:
    """`keep_all` every `every_s` seconds in a thread while the comparison runs, and once at the end."""

    def __init__(self, out: Path, archive: Path, every_s: float = 30.0) -> None:
        self.out, self.archive, self.every_s = out, archive, every_s
        self.kept = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.kept += keep_all(self.out, self.archive)

    def __enter__(self) -> "Keeper":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.kept += keep_all(self.out, self.archive)
