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
        if len(words(text)) < SPEC.shingle_words:
            assert not len(shingles) and (row == SENTINEL).all()
        else:
            assert len(shingles) == len(words(text)) - SPEC.shingle_words + 1
            np.testing.assert_array_equal(row, np.concatenate(step.get_signature(shingles.reshape(-1, 1))))


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
