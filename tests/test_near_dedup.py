"""The prepare's vectorised MinHash stages against datatrove's own classes (the truth): the
signatures equal the library's `get_signature` document by document, the signature files and the
buckets' duplicate pairs are byte for byte what the library's `MinhashDedupSignature` and
`MinhashDedupBuckets` write for the same shingle hashes, and the record order equals a full sort."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
from datatrove.data import Document
from datatrove.pipeline.dedup.minhash import SENTINEL, MinhashDedupBuckets, MinhashDedupSignature

from specs.task import DedupSpec
from trainer.data import near_dedup
from trainer.data.dedup import words

SPEC = DedupSpec(num_perm=32, bands=4, shingle_words=3)


class LibrarySignature(MinhashDedupSignature):
    """datatrove's stage 1 as is, one document at a time, hashing shingles as the prepare does (the
    prepare's shingle hash is the only part not the library's: its SHA-1 is per shingle in Python)."""

    def __init__(self, folder: Path, ours: near_dedup.ScannedSignatures) -> None:
        super().__init__(str(folder), ours.config, language=near_dedup.ShingleWords())
        self.ours = ours

    def get_shingles(self, text: str) -> np.ndarray:
        return self.ours.shingle_hashes([words(text)])[0].reshape(-1, 1)


def corpus(rng: random.Random, documents: int) -> list[str]:
    """Short and empty documents (no shingle), exact copies and one-word edits (shared bands)."""
    vocab = [f"w{i}" for i in range(60)]
    texts: list[str] = []
    for _ in range(documents):
        roll = rng.random()
        if texts and roll < 0.2:
            texts.append(rng.choice(texts))
        elif texts and roll < 0.35:
            edited = rng.choice(texts).split()
            if edited:
                edited[rng.randrange(len(edited))] = "zebra"
            texts.append(" ".join(edited))
        else:
            texts.append(" ".join(rng.choice(vocab) for _ in range(rng.choice([0, 2, 5, 20, 40]))))
    return texts


def write_both(tmp_path: Path, parts: list[list[str]]) -> tuple[Path, Path]:
    """Signature files of each part (task rank = part) by the library's class and by ours."""
    ours = near_dedup.signature_step(tmp_path / "ours", SPEC)
    signatures = [ours.signatures([words(t) for t in texts]) for texts in parts]
    ours.read_part = signatures.__getitem__
    library = LibrarySignature(tmp_path / "library" / near_dedup.SIGNATURES, ours)
    for rank, texts in enumerate(parts):
        library.run(iter([Document(text=t, id=str(i)) for i, t in enumerate(texts)]), rank=rank)
        ours.run(None, rank=rank)
    return tmp_path / "library", tmp_path / "ours"


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def test_signatures_are_the_librarys_get_signature_of_each_document() -> None:
    step = near_dedup.signature_step(Path("unused"), SPEC)
    texts = corpus(random.Random(1), 300)
    docs_words = [words(t) for t in texts]
    ours = step.signatures(docs_words, chunk=64)  # small blocks: many cut at document boundaries
    for text, row in zip(texts, ours):
        shingles = step.shingle_hashes([words(text)])[0]
        if not words(text):
            assert not len(shingles) and (row == SENTINEL).all()
        else:  # a document shorter than a shingle is one shingle
            assert len(shingles) == max(1, len(words(text)) - SPEC.shingle_words + 1)
            np.testing.assert_array_equal(row, np.concatenate(step.get_signature(shingles.reshape(-1, 1))))


def test_a_short_paragraph_repeated_with_other_punctuation_is_one_signature() -> None:
    """Shorter than a shingle, it is one shingle of its words: the same words give the same
    signature whatever the punctuation and case, and other words another (the library's `ngrams`
    would give neither a record, so such repeats were never found)."""
    step = near_dedup.signature_step(Path("unused"), SPEC)
    a, b, c, d = step.signatures([words("Go on!"), words("go, on."), words("on go"), words("go")])
    assert (a != SENTINEL).all() and (a == b).all()
    assert (a != c).mean() > 0.9 and (a != d).mean() > 0.9


def test_signature_files_and_bucket_pairs_are_byte_for_byte_the_librarys(tmp_path: Path) -> None:
    rng = random.Random(2)
    texts = corpus(rng, 400)
    library, ours = write_both(tmp_path, [texts[:150], texts[150:160], [], texts[160:]])
    assert folder_bytes(library / near_dedup.SIGNATURES) == folder_bytes(ours / near_dedup.SIGNATURES)
    config = near_dedup.minhash_config(SPEC)
    for band in range(SPEC.bands):
        MinhashDedupBuckets(str(library / near_dedup.SIGNATURES), str(library / near_dedup.BUCKETS),
                            config=config).run(None, rank=band, world_size=SPEC.bands)
        near_dedup.bucket_step(ours, SPEC).run(None, rank=band, world_size=SPEC.bands)
    pairs = folder_bytes(library / near_dedup.BUCKETS)
    assert len(pairs) == SPEC.bands and all(len(p) for p in pairs.values())  # the copies pair up
    assert folder_bytes(ours / near_dedup.BUCKETS) == pairs


def test_record_order_is_a_full_sort_by_hashes_then_ties() -> None:
    rng = np.random.default_rng(3)
    hashes = rng.integers(0, 3, size=(2000, 4)).astype(np.uint32)  # few values: ties at every column
    files, rows = rng.integers(0, 3, size=2000), rng.permutation(2000)
    order = near_dedup.record_order(hashes, files, rows)
    np.testing.assert_array_equal(order, np.lexsort((rows, files, *hashes.T[::-1])))


def run_stages(folder: Path, parts: list[np.ndarray], candidates: list[np.ndarray]) -> np.ndarray:
    """The prepare's MinHash stages over given signatures (one (rows, num_perm) array per part):
    signature files, buckets over the candidates, verified pairs, datatrove's clusters, then which
    candidates go. Returns the near-duplicate mask in global row order."""
    step = near_dedup.signature_step(folder, SPEC, parts.__getitem__)
    for rank in range(len(parts)):
        step.run(None, rank=rank)
    starts = np.cumsum([0] + [len(p) for p in parts])[:-1]

    def signatures(ranks: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return np.stack([parts[r][i] for r, i in zip(ranks, rows)]).astype(np.uint32)

    for band in range(SPEC.bands):
        near_dedup.bucket_step(folder, SPEC, candidates.__getitem__).run(None, rank=band, world_size=SPEC.bands)
    near_dedup.verify_step(folder, SPEC, signatures).run(None)
    near_dedup.cluster_step(folder, SPEC).run(None)
    total = sum(len(p) for p in parts)
    return near_dedup.near_duplicates(near_dedup.cluster_ids(folder, starts, total), np.concatenate(candidates))


def test_near_duplicates_across_many_parts_survive_chance_band_links(tmp_path: Path) -> None:
    """24 parts; 150 originals, each with a near copy (30 of 32 hashes equal) in a later part. The
    originals are chained into one LSH component two ways: documents that are no candidates (exact
    copies, junk) and candidates that share one band with one original and another band with the
    next (chance collisions, similarity 1/4 or less). Truth: exactly the 150 copies go, every
    collision stays. Clusters of unverified pairs over every document lost copies here as the
    corpus grew (a copy was checked against its cluster's first candidate and its predecessor)."""
    rng = np.random.default_rng(0)
    per_band, n_parts, rows = SPEC.num_perm // SPEC.bands, 24, 60
    signature = rng.integers(0, 2**32 - 1, size=(n_parts * rows, SPEC.num_perm), dtype=np.uint64).astype(np.uint32)
    candidate = np.ones(n_parts * rows, dtype=bool)
    half = rows // 2  # originals in the first half of parts 0..22; copies and links in the second
    first_halves = (np.arange(n_parts - 1)[:, None] * rows + np.arange(half)[None, :]).ravel()
    originals = np.sort(rng.choice(first_halves, size=150, replace=False))
    free = list(rng.permutation((np.arange(1, n_parts)[:, None] * rows + np.arange(half, rows)[None, :]).ravel()))
    expected = []
    for k, original in enumerate(originals):
        copy = next(s for s in free if s // rows > original // rows)  # a later part
        free.remove(copy)
        signature[copy] = signature[original]
        changed = rng.choice(SPEC.num_perm, size=2, replace=False)
        signature[copy, changed] ^= np.uint32(0x5A5A5A5A)
        expected.append(copy)
        if k + 1 < len(originals):  # link this original to the next through a chance collision
            link = free.pop()
            band_a, band_b = (0, 1) if k % 2 else (2, 3)
            signature[link, band_a * per_band:(band_a + 1) * per_band] = \
                signature[original, band_a * per_band:(band_a + 1) * per_band]
            signature[link, band_b * per_band:(band_b + 1) * per_band] = \
                signature[originals[k + 1], band_b * per_band:(band_b + 1) * per_band]
            candidate[link] = bool(k % 3)  # a third of the links are no candidates
    parts = [signature[r * rows:(r + 1) * rows] for r in range(n_parts)]
    keep = [candidate[r * rows:(r + 1) * rows] for r in range(n_parts)]
    dup = run_stages(tmp_path, parts, keep)
    got, want = set(np.flatnonzero(dup).tolist()), {int(e) for e in expected}
    assert got == want, (sorted(got - want), sorted(want - got))
