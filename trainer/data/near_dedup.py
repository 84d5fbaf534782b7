"""Near duplicates through datatrove's MinHash stages, resolved by our rule of which document stays.

datatrove (the library behind FineWeb's pipelines) deduplicates in four stages: signatures per
task (`MinhashDedupSignature`: per LSH band, each document's row of hashes, sorted), buckets
(`MinhashDedupBuckets`: one task per band merges the tasks' sorted files and writes every pair of
documents whose whole band is equal), clusters (`MinhashDedupCluster`: union-find over those
pairs, one cluster id per document) and a filter that drops all but one member per cluster.

The prepare runs the first three as datatrove runs them: signatures in each scan task (one task
per part, so a document is (part, row in part)), buckets and clusters on the same executor after
the scan. The fourth is ours (`near_duplicates`): which documents may take part is known only
after the scan (the stages' quality thresholds, exact duplicates), the eval files come first
(decontamination), and the first candidate of a cluster is kept, so the output does not depend
on how many workers ran. Each cluster's candidates are verified as before: a member whose
estimated Jaccard similarity (the share of equal signature hashes) with the cluster's first
candidate or with its previous candidate reaches the threshold joins them; members that verify
against nobody stay.

Parameters follow the task's `dedup` spec: `shingle_words`-word shingles over the same words as
before (lower-cased runs of word characters: `ShingleWords`, with datatrove's own text
normalisation off), `bands` buckets of `num_perm / bands` hashes each, 32-bit hashes (datatrove's
SHA-1 shingle hash: its xxhash path passes text where the installed xxhash wants bytes).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster,
                                              MinhashDedupSignature)
from datatrove.utils.hashing import HashConfig
from datatrove.utils.text import TextNormConfig
from datatrove.utils.word_tokenizers import WordTokenizer
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from specs.task import DedupSpec
from trainer.data.dedup import WORD_RE

SIGNATURES, BUCKETS, CLUSTERS = "minhash/signatures", "minhash/buckets", "minhash/clusters"
# datatrove's text normalisation would fold digits and strip punctuation; the words are ours
_AS_IS = TextNormConfig(lowercase=True, norm_whitespace=False, remove_punctuation=False,
                        norm_unicode_diacritics=False, norm_numbers=False)


class ShingleWords(WordTokenizer):
    """The words shingles are made of: runs of word characters (the text is lower-cased first)."""

    def __init__(self) -> None:
        super().__init__("advisor-words")

    def word_tokenize(self, text: str) -> list[str]:
        return WORD_RE.findall(text)

    def sent_tokenize(self, text: str) -> list[str]:
        return [text]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        return [match.span() for match in WORD_RE.finditer(text)]


def minhash_config(dedup: DedupSpec) -> MinhashConfig:
    return MinhashConfig(n_grams=dedup.shingle_words, num_buckets=dedup.bands,
                         hashes_per_bucket=dedup.num_perm // dedup.bands, seed=1, norm_config=_AS_IS,
                         hash_config=HashConfig(precision=32, hash_fc="sha1"))


def signature_step(work: Path, dedup: DedupSpec) -> MinhashDedupSignature:
    """Stage 1, run in each scan task after the scan: its input is the part's documents in row order."""
    return MinhashDedupSignature(str(work / SIGNATURES), minhash_config(dedup), language=ShingleWords())


def bucket_step(work: Path, dedup: DedupSpec) -> MinhashDedupBuckets:
    """Stage 2: one task per band."""
    return MinhashDedupBuckets(str(work / SIGNATURES), str(work / BUCKETS), config=minhash_config(dedup))


def cluster_step(work: Path, dedup: DedupSpec) -> MinhashDedupCluster:
    """Stage 3: one task; writes each clustered document's cluster id per part."""
    return MinhashDedupCluster(str(work / BUCKETS), str(work / CLUSTERS), config=minhash_config(dedup),
                               save_cluster_id=True)


def cluster_ids(work: Path, part_starts: np.ndarray, total: int) -> np.ndarray:
    """Per document of the task (global row order): its cluster id from stage 3, -1 if in none.
    `part_starts[r]`: the global row of part r's first row."""
    cluster = np.full(total, -1, dtype=np.int64)
    for rank, start in enumerate(part_starts):
        file = work / CLUSTERS / f"{rank:06d}.clusters"
        if file.is_file():
            pairs = np.fromfile(file, dtype="<u4").reshape(-1, 2).astype(np.int64)
            cluster[start + pairs[:, 0]] = pairs[:, 1]
    return cluster


def part_signatures(work: Path, dedup: DedupSpec, rank: int, rows: int) -> np.ndarray:
    """(rows, num_perm) uint32: the signatures stage 1 wrote for part `rank`, one file per band
    (sorted by hash, each record its document's row in the part). A document without a shingle
    (fewer words than a shingle) has no record: its row stays all ones, equal to no real row."""
    per_band = dedup.num_perm // dedup.bands
    record = np.dtype([("hashes", "<u4", (per_band,)), ("row", "<u4")])
    out = np.full((rows, dedup.num_perm), np.iinfo(np.uint32).max, dtype=np.uint32)
    for band in range(dedup.bands):
        records = np.fromfile(work / SIGNATURES / f"bucket_{band:03d}" / f"{rank:05d}.minhash.sig", dtype=record)
        out[records["row"], band * per_band:(band + 1) * per_band] = records["hashes"]
    return out


def near_duplicates(cluster: np.ndarray, candidates: np.ndarray, signatures: np.ndarray,
                    threshold: float) -> np.ndarray:
    """Bool mask: candidates that a verified link joins to an earlier candidate of their cluster.
    `signatures` holds the rows of `np.flatnonzero(candidates & (cluster >= 0))`, in that order."""
    members = np.flatnonzero(candidates & (cluster >= 0))
    dup = np.zeros(len(cluster), dtype=bool)
    if not len(members):
        return dup
    order = np.lexsort((members, cluster[members]))  # by cluster, then row
    ids = cluster[members][order]
    starts = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]]))
    first = starts[np.searchsorted(starts, np.arange(len(order)), side="right") - 1]
    later = np.flatnonzero(first != np.arange(len(order)))
    pairs = np.concatenate([np.stack([first[later], later], 1), np.stack([later - 1, later], 1)])
    a, b = order[pairs[:, 0]], order[pairs[:, 1]]
    verified = (signatures[a] == signatures[b]).mean(axis=1) >= threshold
    graph = coo_matrix((np.ones(int(verified.sum())), (a[verified], b[verified])), shape=(len(members),) * 2)
    _, component = connected_components(graph, directed=False)
    # the first (smallest row) member of each component stays: members are in row order
    _, first_of_component = np.unique(component, return_index=True)
    dup[members] = True
    dup[members[first_of_component]] = False
    return dup
