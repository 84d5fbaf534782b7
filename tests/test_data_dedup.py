"""Duplicates planted in a generated corpus are all removed, and nothing else is.

The truth is the generator's own labels, checked by brute force: every planted near duplicate is
within 5-word-shingle Jaccard >= 0.9 of its original, every other pair of kept documents below 0.6.
"""

from __future__ import annotations

import json
import random
from functools import lru_cache
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
import yaml

from presets import load_task
from specs.task import DedupSpec
from trainer.data import near_dedup
from trainer.data.dedup import candidate_probability, words
from trainer.data.prepare import prepare
from trainer.data.shards import load_shard

SHINGLE = 5


@lru_cache(maxsize=None)
def shingles(text: str) -> frozenset[tuple[str, ...]]:
    ws = words(text)
    return frozenset(tuple(ws[i:i + SHINGLE]) for i in range(max(1, len(ws) - SHINGLE + 1)))


def jaccard(a: str, b: str) -> float:
    sa, sb = shingles(a), shingles(b)
    return len(sa & sb) / len(sa | sb)


def planted_corpus(seed: int = 7) -> tuple[list[dict], list[dict], dict[str, set[tuple[str, int]]]]:
    """(train rows of two files, eval rows, labels): originals, hard negatives (about half the words
    changed: similar but not duplicates), exact copies, case/whitespace variants, one-word edits of
    long documents, a copy in the other file, and copies of eval documents (contamination)."""
    rng = random.Random(seed)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))) for _ in range(4000)]

    def doc(n: int) -> str:
        return " ".join(rng.choice(vocab) for _ in range(n)).capitalize() + "."

    eval_rows = [{"text": doc(rng.randint(40, 80)), "id": f"eval{i}"} for i in range(20)]
    files: list[list[dict]] = [[], []]
    labels: dict[str, set[tuple[str, int]]] = {"exact": set(), "near": set(), "kept": set()}
    originals: list[str] = []

    def add(file: int, text: str, label: str) -> None:
        files[file].append({"text": text})
        labels[label].add((f"a{file}.jsonl", len(files[file]) - 1))

    for _ in range(120):
        text = doc(rng.randint(100, 140))  # one changed word keeps 5-word-shingle Jaccard >= 0.9
        originals.append(text)
        add(0, text, "kept")
    for _ in range(20):  # hard negatives: every second word replaced
        ws = rng.choice(originals).split()
        add(0, " ".join(w if i % 2 else rng.choice(vocab) for i, w in enumerate(ws)), "kept")
    for i in range(15):
        add(0, originals[i], "exact")
    for i in range(15, 25):  # case and whitespace changes only
        add(0, "  " + originals[i].upper().replace(" ", "   \n"), "exact")
    for i in range(25, 45):  # one word changed in a long document
        ws = originals[i].split()
        ws[len(ws) // 2] = "zzplanted"
        add(0, " ".join(ws), "near")
    for i in range(45, 55):  # the same document in the second file
        add(1, originals[i], "exact")
    for i in range(5):  # an eval document in the train data
        add(1, eval_rows[i]["text"], "exact")
    for _ in range(30):
        add(1, doc(rng.randint(50, 90)), "kept")
    return files[0] + [{"__file__": 1}] + files[1], eval_rows, labels


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory):
    return _prepare_planted(tmp_path_factory.mktemp("dedup"))


def _prepare_planted(tmp: Path, **options):
    rows, eval_rows, labels = planted_corpus()
    cut = rows.index({"__file__": 1})
    write_jsonl(tmp / "a0.jsonl", rows[:cut])
    write_jsonl(tmp / "a1.jsonl", rows[cut + 1:])
    write_jsonl(tmp / "held_out.jsonl", eval_rows)
    task = {"name": "dedup", "model": "demo-tiny", "seq_len": 512,
            "data": {"filters": {"min_tokens": 1}},
            "stages": [{"name": "only", "tokens": 1000,
                        "sources": [{"path": "a0.jsonl"}, {"path": "a1.jsonl"}],
                        "eval_sources": [{"path": "held_out.jsonl"}]}]}
    (tmp / "task.yaml").write_text(yaml.safe_dump(task))
    out, manifest = prepare(load_task(str(tmp / "task.yaml")), **options)
    texts = {("a0.jsonl", i): r["text"] for i, r in enumerate(rows[:cut])}
    texts |= {("a1.jsonl", i): r["text"] for i, r in enumerate(rows[cut + 1:])}
    return out, manifest, labels, texts, eval_rows


def kept_rows(out: Path, manifest: dict, split: str = "train") -> set[tuple[str, int]]:
    kept = set()
    for shard in manifest["stages"][0][split]["shards"]:
        ds = load_shard(out / shard["path"])
        kept |= {(s, r) for s, r in zip(ds["source"], ds["row"])}
    return kept


def test_planted_labels_hold_by_brute_force(prepared) -> None:
    _, _, labels, texts, eval_rows = prepared
    originals = [texts[k] for k in sorted(labels["kept"])]
    for key in labels["near"]:
        assert max(jaccard(texts[key], o) for o in originals) >= 0.9
    for a, b in combinations(sorted(labels["kept"]), 2):
        assert jaccard(texts[a], texts[b]) < 0.6, (a, b)
    for key in labels["kept"]:
        assert all(jaccard(texts[key], e["text"]) < 0.6 for e in eval_rows)


def test_all_planted_duplicates_are_removed_and_nothing_else(prepared) -> None:
    out, manifest, labels, _, _ = prepared
    assert kept_rows(out, manifest) == labels["kept"]
    dropped = manifest["stages"][0]["train"]["dropped"]
    assert dropped == {"exact_duplicate": len(labels["exact"]), "near_duplicate": len(labels["near"])}


def test_eval_documents_are_kept_and_decontaminate_train(prepared) -> None:
    out, manifest, _, _, eval_rows = prepared
    assert kept_rows(out, manifest, "eval") == {("held_out.jsonl", i) for i in range(len(eval_rows))}


def _shard_bytes(out: Path, manifest: dict) -> dict[str, bytes]:
    return {s["path"]: (out / s["path"]).read_bytes() for stage in manifest["stages"] for split in ("train", "eval")
            for s in stage[split]["shards"]}


def _without_times(manifest: dict) -> dict:
    """The manifest but for when it was written and where (the fingerprint hashes the files' paths)."""
    same = {k: v for k, v in manifest.items() if k not in ("created", "seconds", "fingerprint", "sources")}
    return same | {"sources": [(Path(s["path"]).name, s["rows"]) for s in manifest["sources"]]}


@pytest.mark.parametrize("workers", [1, 2])
def test_scanning_in_parts_on_any_number_of_workers_keeps_and_drops_the_same_documents(
        prepared, tmp_path: Path, workers: int) -> None:
    """The files cut into parts of 40 rows (a0: 5 parts, a1: 2, the eval file: 1), scanned by 1 and
    by 2 worker processes: the same kept and dropped sets as the labels and as one whole-file scan
    (the fixture's), and byte-identical shards and manifest but for its timestamps."""
    whole_out, whole_manifest, labels, _, _ = prepared
    out, manifest, _, _, _ = _prepare_planted(tmp_path, workers=workers, rows_per_part=40)
    assert kept_rows(out, manifest) == labels["kept"]
    assert manifest["stages"][0]["train"]["dropped"] == {"exact_duplicate": len(labels["exact"]),
                                                         "near_duplicate": len(labels["near"])}
    assert _without_times(manifest) == _without_times(whole_manifest)
    assert _shard_bytes(out, manifest) == _shard_bytes(whole_out, whole_manifest)
    assert not list(tmp_path.glob(".*scan-*")), "the scan's work folder is removed once the output is whole"


def _signature(step, text: str) -> np.ndarray:
    return step.signatures([words(text)])[0]


def test_datatrove_minhash_over_our_words_estimates_jaccard_and_lsh_follows_the_s_curve(tmp_path: Path) -> None:
    """The signatures the scan computes for datatrove's signature stage, configured from the dedup
    spec, shingle the same words as the brute-force truth (`words`): their share of equal hashes
    estimates the Jaccard similarity."""
    rng = random.Random(3)
    vocab = [f"w{i}" for i in range(500)]
    step = near_dedup.signature_step(tmp_path, DedupSpec(num_perm=256, bands=16, shingle_words=SHINGLE))
    base = [rng.choice(vocab) for _ in range(200)]
    for changed in (5, 20, 60, 120):
        other = list(base)
        for i in rng.sample(range(200), changed):
            other[i] = rng.choice(vocab)
        a, b = " ".join(base), "  ".join(other).upper() + "!"  # case, spacing and punctuation do not count
        estimate = float((_signature(step, a) == _signature(step, b)).mean())
        # standard error of the estimate is sqrt(J(1-J)/k) <= 0.031 for k=256: allow 4 of them
        assert abs(estimate - jaccard(a, b)) < 0.125, changed
    assert candidate_probability(0.9, 16, 8) > 0.999 and candidate_probability(0.3, 16, 8) < 0.002


def test_of_a_cluster_the_first_candidate_stays() -> None:
    """Rows 0..6; cluster 5 = {1, 3, 4, 6}, cluster 9 = {0, 2}; row 2 is no candidate (an exact
    duplicate, say, whose pairs the buckets never made). The pairs in a cluster were verified
    before it was formed (tests/test_near_dedup.py), so all but its first candidate go."""
    cluster = np.array([9, 5, 9, 5, 5, -1, 5])
    candidates = np.array([True, True, False, True, True, True, True])
    dup = near_dedup.near_duplicates(cluster, candidates)
    assert np.flatnonzero(dup).tolist() == [3, 4, 6]
