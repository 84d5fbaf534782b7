"""Near duplicates through datatrove's MinHash stages, resolved by our rule of which document stays.

datatrove (the library behind FineWeb's pipelines) deduplicates in four stages: signatures per
task (`MinhashDedupSignature`: per LSH band, each document's row of hashes, sorted), buckets
(`MinhashDedupBuckets`: one task per band merges the tasks' sorted files and writes every pair of
documents whose whole band is equal), clusters (`MinhashDedupCluster`: union-find over those
pairs, one cluster id per document) and a filter that drops all but one member per cluster.

The prepare runs them so:
1. signatures in each scan task (one task per part, so a document is (part, row in part)):
   `ScannedSignatures`, the library's class with its per-document Python loop vectorised (as is, it
   doubled the CPU of a prepare); its files are the library's, byte for byte (tests/test_near_dedup.py);
2. buckets after the scan, once the documents that take part are known (they pass a stage's quality
   thresholds and are no exact duplicate): `SortedBuckets`, vectorised too, leaves the others out,
   and pairs each record with the one before it (the library's pairs) and with the first of its run;
3. ours: `VerifiedPairs` keeps the pairs whose estimated Jaccard similarity (the share of equal
   signature hashes) reaches the threshold, so a chance band collision joins nothing;
4. the library's clusters over the verified pairs, as is;
5. ours (`near_duplicates`): of each cluster the first candidate (the smallest global row) stays.
   The eval files come first (decontamination), and the output does not depend on how many
   workers ran.
Stages 2 to 4 run on datatrove's local executor in the prepare's process.

Two rules are ours where the library's differ, each measured against the code it replaced:
- a document shorter than a shingle is one shingle (`ScannedSignatures.shingle_hashes`); with the
  library's rule (none) a short paragraph repeated with other punctuation was never found: 488 of
  503 planted near duplicates at 200k documents, 5,372 of 6,014 at 1 GB, where this rule finds
  them all, as the hand-written LSH before it did;
- stage 2 leaves out the documents that do not take part and `VerifiedPairs` checks every pair before
  clustering: with clusters of unverified pairs over every document, each member checked against
  its cluster's first candidate and its predecessor, chance band links chained 150 planted copies
  in 24 parts into one cluster and 1 copy was found (tests/test_near_dedup.py); now all 150.

Parameters follow the task's `dedup` spec: `shingle_words`-word shingles over the same words as
before (lower-cased runs of word characters: `ShingleWords`, with datatrove's own text
normalisation off), `bands` buckets of `num_perm / bands` hashes each, 32-bit hashes. A shingle's
hash is ours (its words' SipHash, mixed by position, vectorised over a batch) where the library
takes a SHA-1 of the shingle's text, one Python call per shingle; the permutations are the library's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pandas as pd
from datatrove.data import DocumentsPipeline
from datatrove.io import get_datafolder
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.dedup.minhash import (SENTINEL, MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster,
                                              MinhashDedupSignature)
from datatrove.utils.hashing import HashConfig
from datatrove.utils.text import TextNormConfig
from datatrove.utils.typeshelper import StatHints
from datatrove.utils.word_tokenizers import WordTokenizer

from specs.task import DedupSpec
from trainer.data.dedup import WORD_RE

SIGNATURES, BUCKETS, VERIFIED, CLUSTERS = ("minhash/signatures", "minhash/buckets", "minhash/verified",
                                           "minhash/clusters")
_MERSENNE = np.uint64((1 << 61) - 1)  # the library's modulus
_LOW32 = np.uint64(0xFFFFFFFF)
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


class ScannedSignatures(MinhashDedupSignature):
    """Stage 1 as datatrove's class, vectorised: the same permutations ((a x + b) mod (2^61 - 1),
    low 32 bits, a and b drawn by the library's `parameters` from the config's seed), the same
    sorted per-band files, the same rule that a document without a shingle gets no record (here only
    an empty one: see `shingle_hashes`).

    Not the library's class as is because it hashes one document at a time in Python (a SHA-1 per
    shingle, a numpy call per document, a struct per record): about twice the CPU of the whole
    prepare. Here the scan computes a batch's signatures with numpy from the words it has already
    split (`signatures`, spooled as the part's `signature` column) and `run` writes the part's
    files from that column; shingle hashes are the words' SipHash (pandas) mixed by position.
    """

    def __init__(self, output_folder: str, config: MinhashConfig,
                 read_part: Callable[[int], np.ndarray] | None = None) -> None:
        super().__init__(output_folder, config, language=ShingleWords())
        self.read_part = read_part  # rank -> (rows, num_perm) signatures the scan spooled
        self._word_mult = np.random.RandomState(config.seed).randint(
            1, 1 << 62, size=config.n_grams, dtype=np.uint64) * np.uint64(2) + np.uint64(1)

    def shingle_hashes(self, docs_words: Sequence[Sequence[str]]) -> tuple[np.ndarray, np.ndarray]:
        """32-bit hashes of every document's shingles (n consecutive words), concatenated, and
        each document's shingle count. A document shorter than n words is one shingle of all its
        words, as our rule always had it: the library's `ngrams` gives it none, so the same short
        paragraph with other punctuation was never found (11% of the planted near duplicates of the
        1 GB bench). An empty document has none (its text is an exact duplicate of any other)."""
        n = self.config.n_grams
        lengths = np.fromiter((len(w) for w in docs_words), dtype=np.int64, count=len(docs_words))
        flat = [w for ws in docs_words for w in ws]
        word_hash = pd.util.hash_array(np.asarray(flat, dtype=object)) if flat else np.zeros(0, np.uint64)
        counts = np.where(lengths > 0, np.maximum(lengths - n + 1, 1), 0)
        # shingle j of a document starting at word s: words s+j .. s+j+width-1, all inside the document
        starts = np.repeat(np.cumsum(lengths) - lengths - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
        width = np.repeat(np.minimum(lengths, n), counts)
        combined = np.zeros(len(starts), dtype=np.uint64)
        with np.errstate(over="ignore"):
            for k in range(n):
                inside = np.flatnonzero(width > k)
                combined[inside] += word_hash[starts[inside] + k] * self._word_mult[k]
        return (combined >> np.uint64(32)) ^ (combined & _LOW32), counts

    def signatures(self, docs_words: Sequence[Sequence[str]], chunk: int = 1024) -> np.ndarray:
        """(documents, num_perm) uint32, equal to the library's `get_signature` of each document's
        shingle hashes; an empty document gets a row of SENTINEL (it gets no record)."""
        shingles, counts = self.shingle_hashes(docs_words)
        out = np.full((len(docs_words), self.num_hashes), SENTINEL, dtype=np.uint32)
        docs = np.flatnonzero(counts)
        offsets = np.concatenate([[0], np.cumsum(counts[docs])])
        a, b = (p.reshape(-1, 1) for p in self.parameters)
        # blocks of about `chunk` shingles cut at document boundaries (a block stays in cache)
        cuts = np.unique(np.append(np.searchsorted(offsets, np.arange(0, offsets[-1], chunk), side="right") - 1,
                                   len(docs)))
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            block = _permuted(shingles[offsets[lo]:offsets[hi]], a, b)
            out[docs[lo:hi]] = np.minimum.reduceat(block, offsets[lo:hi] - offsets[lo], axis=1).T
        return out

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> None:
        for _ in data or ():  # the scan before this step in the task: it spools the signatures
            pass
        assert self.read_part is not None, "ScannedSignatures.run needs read_part"
        with self.track_time():
            signatures = self.read_part(rank)
            rows = np.flatnonzero((signatures != SENTINEL).any(axis=1))
            self.stat_update(StatHints.total, value=len(signatures))
            per_band = self.config.hashes_per_bucket
            for band in range(self.config.num_buckets):
                hashes = signatures[rows, band * per_band:(band + 1) * per_band]
                order = record_order(hashes, rows)  # the library's order: by hashes, then row
                records = np.empty((len(rows), per_band + 1), dtype="<u4")  # hashes, then the row
                records[:, :per_band], records[:, per_band] = hashes[order], rows[order]
                with self.output_folder.open(f"bucket_{band:03d}/{rank:05d}.minhash.sig", mode="wb") as sink:
                    sink.write(records.tobytes())


def record_order(hashes: np.ndarray, *ties: np.ndarray) -> np.ndarray:
    """The order that sorts records by their row of `hashes` (uint32, one row each), then by
    `ties` (the first first): one stable sort of the first two hashes as one 64-bit key, then a
    full sort of only the records tied on that key (about the duplicates alone), faster than
    numpy's sort of structured records."""
    key = hashes[:, 0].astype(np.uint64) << np.uint64(32)
    if hashes.shape[1] > 1:
        key |= hashes[:, 1]
    order = np.argsort(key, kind="stable")
    same = key[order][1:] == key[order][:-1]
    tied = np.flatnonzero(np.concatenate([same, [False]]) | np.concatenate([[False], same]))
    if len(tied):  # the tied records are contiguous runs of one key each: re-sorted in place
        sub = order[tied]
        order[tied] = sub[np.lexsort((*[t[sub] for t in ties[::-1]], *hashes[sub, 2:].T[::-1], key[sub]))]
    return order


def _permuted(shingles: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(num_perm, shingles) uint64: ((a x + b) mod 2^64) mod (2^61 - 1), low 32 bits, as the
    library's `get_signature` computes it. The modulo by the Mersenne prime p is folded (x mod p =
    (x & p) + (x >> 61), less p once if that reaches p): faster than numpy's `%`."""
    block = a * shingles[None, :]
    block += b
    folded = block & _MERSENNE
    block >>= np.uint64(61)
    folded += block
    over = folded >= _MERSENNE
    if over.any():  # p = -1 mod 2^32, so subtracting p adds 1 to the low 32 bits
        folded[over] += np.uint64(1)
    folded &= _LOW32
    return folded


def signature_step(work: Path, dedup: DedupSpec,
                   read_part: Callable[[int], np.ndarray] | None = None) -> ScannedSignatures:
    """Stage 1, run in each scan task after the scan: writes the part's files from the signatures
    the scan spooled (`read_part(rank)`)."""
    return ScannedSignatures(str(work / SIGNATURES), minhash_config(dedup), read_part)


def scan_signer(work: Path, dedup: DedupSpec) -> Callable[[Sequence[Sequence[str]]], np.ndarray] | None:
    """What the scan computes each batch's signatures with (None: near duplicates off)."""
    return signature_step(work, dedup).signatures if dedup.near else None


class SortedBuckets(MinhashDedupBuckets):
    """Stage 2 as datatrove's class, vectorised for the one case the prepare runs (one task per
    band, no index): the band's records of every file sorted at once with numpy instead of merged
    record by record through a heap of Python objects. The pairs and their order are the library's:
    records in (hashes, file, row) order, each record paired with the one before it when their
    hashes are equal; a first hash of 2^32 - 1 ends a file's reading there, as in `read_sigs`.

    `keep` leaves out the documents that do not take part (below a stage's quality thresholds,
    exact duplicates), as the library's index leaves out what it already holds: a junk page or an
    exact copy sharing a band would otherwise chain unrelated documents into one cluster. With
    `keep`, each record is also paired with the first of its equal run, as our rule always did: the
    pairs are verified before they are clustered (`VerifiedPairs`), and a chance collision between
    a document and its copy in the sorted run would otherwise hide that band's pair."""

    def __init__(self, input_folder: str, output_folder: str, config: MinhashConfig,
                 keep: Callable[[int], np.ndarray] | None = None) -> None:
        super().__init__(input_folder, output_folder, config=config)
        self.keep = keep  # part rank -> bool per row of the part: the documents that take part

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> None:
        if self.index_folder is not None or world_size != self.config.num_buckets:
            assert self.keep is None, "only the one-task-per-band case can leave documents out"
            return super().run(data, rank, world_size)
        per_band = self.config.hashes_per_bucket
        record = np.dtype([("hashes", "<u4", (per_band,)), ("row", "<u4")])
        with self.track_time():
            files = self.input_folder.list_files(subdirectory=f"bucket_{rank:03d}")
            parts = []
            for file in files:
                with self.input_folder.open(file, mode="rb") as source:
                    records = np.frombuffer(source.read(), dtype=record)
                stem = int(Path(file).name.removesuffix(".minhash.sig"))
                records = records[records["hashes"][:, 0] < self.config.hash_config.max]
                if self.keep is not None:
                    records = records[self.keep(stem)[records["row"]]]
                parts.append((records, stem))
            hashes = np.concatenate([r["hashes"] for r, _ in parts] or [np.zeros((0, per_band), np.uint32)])
            rows = np.concatenate([r["row"] for r, _ in parts] or [np.zeros(0, np.uint32)])
            stems = np.concatenate([np.full(len(r), stem, np.uint32) for r, stem in parts] or [np.zeros(0, np.uint32)])
            files = np.repeat(np.arange(len(parts)), [len(r) for r, _ in parts])
            order = record_order(hashes, files, rows)  # the heap's order: hashes, file, row
            hashes, rows, stems = hashes[order], rows[order], stems[order]
            equal = (hashes[1:] == hashes[:-1]).all(axis=1)
            same = np.flatnonzero(equal) + 1
            before = same - 1
            if self.keep is not None:  # also each record and its group's first (see the class note)
                starts = np.flatnonzero(np.concatenate([[True], ~equal]))
                first = starts[np.searchsorted(starts, same, side="right") - 1]
                later = first != before
                before, same = np.concatenate([before, first[later]]), np.concatenate([same, same[later]])
            pairs = np.stack([stems[before], rows[before], stems[same], rows[same]], axis=1).astype("<u4")
            self.stat_update("total_matches", value=len(pairs))
            with self.output_folder.open(f"{rank:05d}_00.dups", mode="wb") as sink:
                sink.write(pairs.tobytes())


def bucket_step(work: Path, dedup: DedupSpec, keep: Callable[[int], np.ndarray] | None = None) -> SortedBuckets:
    """Stage 2: one task per band, over the documents `keep` lets take part."""
    return SortedBuckets(str(work / SIGNATURES), str(work / BUCKETS), config=minhash_config(dedup), keep=keep)


class VerifiedPairs(PipelineStep):
    """Between stages 2 and 3, ours: each band's pairs whose estimated Jaccard similarity (the
    share of equal signature hashes) reaches the threshold, in the library's file format, one file
    per band (stage 3 wants as many). datatrove trusts a shared band; our rule has always verified
    each candidate pair, so one chance collision does not join two clusters. One task: the pairs of
    every band are read at once and each endpoint's signature is read once (`signatures`: part
    ranks and rows, sorted by part then row -> their (n, num_perm) rows)."""

    type = "🫂 - DEDUP"
    name = "🔍 verify pairs"

    def __init__(self, input_folder: str, output_folder: str, threshold: float,
                 signatures: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> None:
        super().__init__()
        self.input_folder, self.output_folder = get_datafolder(input_folder), get_datafolder(output_folder)
        self.threshold, self.signatures = threshold, signatures

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> None:
        with self.track_time():
            files = sorted(self.input_folder.list_files(glob_pattern="*.dups"))
            pairs = []
            for file in files:
                with self.input_folder.open(file, mode="rb") as source:
                    pairs.append(np.frombuffer(source.read(), dtype="<u4").reshape(-1, 4))
            every = np.concatenate(pairs or [np.zeros((0, 4), "<u4")]).astype(np.uint64)
            keys = np.unique(np.concatenate([every[:, 0] << np.uint64(32) | every[:, 1],
                                             every[:, 2] << np.uint64(32) | every[:, 3]]))
            signature = self.signatures((keys >> np.uint64(32)).astype(np.int64), (keys & _LOW32).astype(np.int64))
            for file, band in zip(files, pairs):
                wide = band.astype(np.uint64)
                a = np.searchsorted(keys, wide[:, 0] << np.uint64(32) | wide[:, 1])
                b = np.searchsorted(keys, wide[:, 2] << np.uint64(32) | wide[:, 3])
                verified = (signature[a] == signature[b]).mean(axis=1) >= self.threshold
                self.stat_update("verified", value=int(verified.sum()))
                self.stat_update("rejected", value=int((~verified).sum()))
                with self.output_folder.open(file, mode="wb") as sink:
                    sink.write(np.ascontiguousarray(band[verified]).tobytes())


def verify_step(work: Path, dedup: DedupSpec,
                signatures: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> VerifiedPairs:
    return VerifiedPairs(str(work / BUCKETS), str(work / VERIFIED), dedup.threshold, signatures)


def cluster_step(work: Path, dedup: DedupSpec) -> MinhashDedupCluster:
    """Stage 3: one task, over the verified pairs; writes each clustered document's cluster id per part."""
    return MinhashDedupCluster(str(work / VERIFIED), str(work / CLUSTERS), config=minhash_config(dedup),
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


def near_duplicates(cluster: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Bool mask: the candidates of a cluster (verified pairs joined by stage 3) but its first, the
    smallest global row, which stays: the eval files come first, and the answer does not depend
    on how many workers ran."""
    members = np.flatnonzero(candidates & (cluster >= 0))
    dup = np.zeros(len(cluster), dtype=bool)
    _, first = np.unique(cluster[members], return_index=True)  # members ascend: the first is the smallest
    dup[members] = True
    dup[members[first]] = False
    return dup
