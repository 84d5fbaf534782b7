"""The embedded demo's curriculum data, generated offline and deterministically from a seed.

Three sub-tasks, as the source article orders them:
- general language: English-like paragraphs from a small grammar and vocabulary shipped here,
  with a long-tailed number of sentences per paragraph;
- arithmetic reasoning: one single-digit addition or subtraction with the answer alone, graded by
  whether the sum carries past 9 (field `carry`);
- instruction following: a word's opposite, a word repeated, the number after a digit (field
  `kind`); the mixed stage gets fresh instructions of its own (mixed.jsonl).
Each skill is a short fixed format over a small set of facts, so that demo-tiny learns it within its
stage on a laptop CPU and the stage-end exact match shows it (and its forgetting and healing).
Arithmetic and instruction rows also carry `prompt` and `completion` (`text` is the two joined): the
stage-end evaluation answers the eval files' prompts greedily and scores them by exact match.
Each has a train file and an eval file (drawn from another random stream), written as jsonl under
`<out>/data/`, the paths `presets/tasks/demo.yaml` names relative to its base_dir.

The `demo` task preset reads them from the cache (`presets.generated_data_dir`): `ensure_generated_data`
writes them there on first use; every verb that reads a task's sources calls it first.
"""

from __future__ import annotations

import json
import math
import os
import random
import secrets
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from specs.errors import UsageError
from specs.task import TaskSpec
from presets import GENERATED_TASK_DATA, PRESETS_DIR, generated_data_dir, load_task

# --- a small English-like grammar -------------------------------------------------------------------

NAMES = ["Anna", "Ben", "Clara", "David", "Emma", "Felix", "Grace", "Hugo", "Iris", "Jack", "Lena", "Max",
         "Nora", "Oscar", "Paula", "Sam", "Tara", "Victor", "Wendy", "Zoe"]
DETERMINERS = ["the", "a", "this", "that", "every", "one", "some", "my", "your", "our"]
ADJECTIVES = ["small", "big", "old", "young", "red", "blue", "green", "quiet", "loud", "happy", "sad", "bright",
              "dark", "warm", "cold", "quick", "slow", "gentle", "brave", "clever", "tired", "busy", "little",
              "tall", "short", "soft", "hard", "new", "strange", "friendly", "wild", "calm", "heavy", "light",
              "sweet", "sharp", "round", "golden", "silver", "wooden"]
NOUNS = ["cat", "dog", "bird", "fish", "horse", "child", "teacher", "farmer", "doctor", "baker", "sailor",
         "king", "queen", "friend", "neighbour", "student", "house", "garden", "river", "forest", "mountain",
         "village", "city", "road", "bridge", "boat", "train", "window", "door", "table", "chair", "book",
         "letter", "song", "story", "picture", "apple", "bread", "cake", "cup", "lamp", "box", "key", "ball",
         "tree", "flower", "stone", "cloud", "star", "moon", "sun", "field", "lake", "shop", "school",
         "market", "kitchen", "ship", "castle", "island"]
PLACES = ["garden", "forest", "village", "city", "river", "market", "kitchen", "school", "park", "harbour",
          "library", "station", "castle", "island", "valley", "bakery"]
# (third person present, past)
INTRANSITIVE = [("sleeps", "slept"), ("runs", "ran"), ("sings", "sang"), ("laughs", "laughed"),
                ("waits", "waited"), ("smiles", "smiled"), ("walks", "walked"), ("jumps", "jumped"),
                ("rests", "rested"), ("dances", "danced"), ("works", "worked"), ("plays", "played"),
                ("listens", "listened"), ("wanders", "wandered"), ("shines", "shone")]
TRANSITIVE = [("sees", "saw"), ("finds", "found"), ("likes", "liked"), ("carries", "carried"),
              ("paints", "painted"), ("opens", "opened"), ("builds", "built"), ("reads", "read"),
              ("watches", "watched"), ("cleans", "cleaned"), ("follows", "followed"), ("helps", "helped"),
              ("remembers", "remembered"), ("brings", "brought"), ("visits", "visited"), ("draws", "drew"),
              ("holds", "held"), ("loves", "loved"), ("sells", "sold"), ("buys", "bought")]
ADVERBS = ["slowly", "quickly", "quietly", "happily", "carefully", "often", "softly", "always", "today",
           "again", "together", "alone", "early", "late", "gladly"]
PREPOSITIONS = ["in", "near", "behind", "under", "over", "beside", "through", "across", "around", "inside"]
CONNECTIVES = ["and", "but", "because", "so", "while", "when", "after", "before"]
OPENERS = ["One morning", "Later", "In the evening", "Then", "After a while", "Every day", "Long ago",
           "That night", "Suddenly", "At noon"]


def _noun_phrase(rng: random.Random) -> str:
    if rng.random() < 0.2:
        return rng.choice(NAMES)
    words = [rng.choice(DETERMINERS)]
    for _ in range(rng.choice((0, 0, 1, 1, 2))):
        words.append(rng.choice(ADJECTIVES))
    words.append(rng.choice(NOUNS))
    return " ".join(words)


def _clause(rng: random.Random, past: bool) -> str:
    subject = _noun_phrase(rng)
    form = 1 if past else 0
    shape = rng.random()
    if shape < 0.35:
        verb = rng.choice(INTRANSITIVE)[form]
        parts = [subject, verb]
        if rng.random() < 0.4:
            parts.append(rng.choice(ADVERBS))
        if rng.random() < 0.5:
            parts += [rng.choice(PREPOSITIONS), "the", rng.choice(PLACES)]
    else:
        verb = rng.choice(TRANSITIVE)[form]
        parts = [subject, verb, _noun_phrase(rng)]
        if rng.random() < 0.35:
            parts += [rng.choice(PREPOSITIONS), _noun_phrase(rng)]
        if rng.random() < 0.2:
            parts.append(rng.choice(ADVERBS))
    return " ".join(parts)


def sentence(rng: random.Random, past: bool) -> str:
    text = _clause(rng, past)
    if rng.random() < 0.3:
        text = f"{text} {rng.choice(CONNECTIVES)} {_clause(rng, past)}"
    if rng.random() < 0.15:
        text = f"{rng.choice(OPENERS)}, {text}"
    text = text[0].upper() + text[1:]
    return text + ("!" if rng.random() < 0.05 else ".")


def paragraph_sentences(rng: random.Random) -> int:
    """Long-tailed: lognormal, median about 4 sentences, a few paragraphs of 40 and more."""
    return max(1, min(60, int(round(rng.lognormvariate(1.4, 0.75)))))


def language_document(rng: random.Random) -> dict:
    past = rng.random() < 0.5
    return {"text": " ".join(sentence(rng, past) for _ in range(paragraph_sentences(rng)))}


# --- the skills: short fixed formats that demo-tiny learns within its stage ------------------------
# Each answer is a few tokens drawn from a small set of facts or a fixed rule, so that a 4M-parameter
# model trained for a few dozen steps on 2 CPU cores answers most held-out prompts exactly (the
# stage-end evaluation scores greedy exact match). The held-out prompts are fresh draws of the same
# facts: exact match measures whether the stage taught its skill, not generalisation beyond it.

def arithmetic_problem(rng: random.Random, carry: bool) -> dict:
    """One single-digit addition or subtraction, the answer alone; `carry`: an addition past 9
    (two answer digits: the harder band)."""
    while True:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        if rng.random() < 0.5:
            question, answer = f"{a}+{b}", a + b
        else:
            a, b = max(a, b), min(a, b)
            question, answer = f"{a}-{b}", a - b
        if (answer > 9) == carry:
            break
    prompt = f"Q: {question}=? A:"
    completion = f" {answer}"
    return {"text": prompt + completion, "prompt": prompt, "completion": completion, "carry": int(carry)}


def arithmetic_document(rng: random.Random) -> dict:
    return arithmetic_problem(rng, rng.random() < 0.25)


# adjective pairs from the grammar's vocabulary: each word's opposite
OPPOSITES = [("big", "small"), ("old", "new"), ("happy", "sad"), ("bright", "dark"), ("warm", "cold"),
             ("quick", "slow"), ("loud", "quiet"), ("hard", "soft"), ("tall", "short"), ("heavy", "light"),
             ("wild", "calm"), ("sweet", "sharp")]
OPPOSITE = {**dict(OPPOSITES), **{b: a for a, b in OPPOSITES}}


def instruction_document(rng: random.Random) -> dict:
    """One of three instruction templates, each with one right answer: a word's opposite (a fact to
    remember), a word repeated (a copy) and the number after a digit (counting on)."""
    kind = rng.choice(("opposite", "repeat", "next"))
    if kind == "opposite":
        word = rng.choice(sorted(OPPOSITE))
        instruction, response = f"give the opposite of {word}.", OPPOSITE[word]
    elif kind == "repeat":
        word = rng.choice(NOUNS)
        instruction, response = f"repeat the word {word}.", word
    else:
        digit = rng.randint(0, 8)
        instruction, response = f"count on from {digit}.", str(digit + 1)
    prompt, completion = f"Instruction: {instruction}\nResponse:", f" {response}"
    return {"text": prompt + completion, "prompt": prompt, "completion": completion, "kind": kind}


# --- files --------------------------------------------------------------------------------------------

Generator = Callable[[random.Random], dict]

DEMO_FILES: dict[str, tuple[Generator, int]] = {
    # name: (document generator, random stream salt); the mixed stage gets fresh instructions
    "language.jsonl": (language_document, 1),
    "language_eval.jsonl": (language_document, 2),
    "arithmetic.jsonl": (arithmetic_document, 3),
    "arithmetic_eval.jsonl": (arithmetic_document, 4),
    "instructions.jsonl": (instruction_document, 5),
    "instructions_eval.jsonl": (instruction_document, 6),
    "mixed.jsonl": (instruction_document, 7),
}
# mean tokens per document with the demo-tiny tokenizer, end of text included (measured on 35k+ each)
TOKENS_PER_DOCUMENT = {language_document: 56.3, arithmetic_document: 10.1, instruction_document: 14.7}
# extra documents for the share that deduplication removes (short instructions repeat; mixed.jsonl
# also repeats some of instructions.jsonl)
DUPLICATE_ALLOWANCE = {"instructions.jsonl": 0.03, "mixed.jsonl": 0.05}
EVAL_MARGIN = 1.1  # an eval file holds a little more than the stage's eval_tokens
# the shipped tokenizer was trained on the version-2 corpus: trainer/data/demo_tokenizer_corpus.py
# Bump when a generator's output changes: corpora generated into the cache before are then rewritten.
# 2: arithmetic and instruction rows carry `prompt` and `completion` (text = prompt + completion, as before)
# 3: learnable skills: single-digit arithmetic with the answer alone; opposite, repeat and count-on instructions
GENERATOR_VERSION = 3
STAMP_NAME = ".generated.json"  # in the cache folder: what its files were generated from, written last
DEMO_SEED = 0  # the preset's data: one seed, so that every run on every machine reads the same files


def demo_document_counts(task: Any = None) -> dict[str, int]:
    """Documents per file, sized from the task's budgets (default: presets/tasks/demo.yaml): one pass
    over a stage's train data, after deduplication, is about its token budget less its replay share,
    and an eval file holds a little over the stage's eval_tokens."""
    if task is None:
        task = load_task("demo")
    counts: dict[str, int] = {}
    for stage in task.stages:
        for source, tokens, margin in (
            [(s, (stage.tokens or 0) * (1 - sum(stage.replay.values())) / len(stage.sources), None)
             for s in stage.sources] + [(s, stage.eval_tokens, EVAL_MARGIN) for s in stage.eval_sources]):
            name = Path(source.path).name
            if name not in DEMO_FILES:
                raise UsageError(f"the demo generator makes {', '.join(DEMO_FILES)}; it has no '{name}'")
            per_document = TOKENS_PER_DOCUMENT[DEMO_FILES[name][0]]
            factor = margin if margin is not None else 1 + DUPLICATE_ALLOWANCE.get(name, 0.0)
            counts[name] = max(counts.get(name, 0), math.ceil(tokens * factor / per_document), 1)
    return counts


def iter_documents(name: str, seed: int = 0, count: int = 1) -> Iterator[dict]:
    generator, salt = DEMO_FILES[name]
    rng = random.Random(seed * 1_000_003 + salt)
    prefix = name.split(".")[0]
    for i in range(count):
        yield {"id": f"{prefix}-{i:06d}", **generator(rng)}


def _write_aside(path: Path, lines: Iterable[str]) -> None:
    """Whole or absent: written to a unique file beside it and renamed, so that processes generating
    the same file at once (same seed, same bytes) never read or leave a partial one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}")  # unique across hosts too
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.writelines(lines)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def generate_demo_corpus(base_dir: Path, seed: int = 0, scale: float = 1.0, write_task: bool = True,
                         task: TaskSpec | None = None) -> dict[str, Path]:
    """Write `<base_dir>/data/*.jsonl`, sized to `task`'s budgets (default presets/tasks/demo.yaml),
    and a copy of demo.yaml as `<base_dir>/task.yaml`, so that `advisor data prepare --task
    <base_dir>/task.yaml` finds the data. `scale` multiplies every file's size. Returns name -> path."""
    data_dir = Path(base_dir) / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for name, count in demo_document_counts(task).items():
        path = data_dir / name
        documents = iter_documents(name, seed, max(1, round(count * scale)))
        _write_aside(path, (json.dumps(doc, ensure_ascii=False) + "\n" for doc in documents))
        written[name] = path
    if write_task:
        task = Path(base_dir) / "task.yaml"
        shutil.copyfile(PRESETS_DIR / "tasks" / "demo.yaml", task)
        written["task.yaml"] = task
    return written


def ensure_generated_data(task: TaskSpec) -> Path | None:
    """Generate a task preset's data on first use: when `task` reads from its preset's cache folder
    (`presets.load_task`) and that folder's stamp does not match this generator, seed and budgets.
    Returns the folder when it wrote it, None when there was nothing to do."""
    folder = Path(task.base_dir)
    if task.name not in GENERATED_TASK_DATA or folder.resolve() != generated_data_dir(task.name).resolve():
        return None
    expected = {"generator_version": GENERATOR_VERSION, "seed": DEMO_SEED, "documents": demo_document_counts(task)}
    stamp = folder / STAMP_NAME
    try:
        if json.loads(stamp.read_text()) == expected and all(
                (folder / "data" / name).is_file() for name in expected["documents"]):
            return None
    except (OSError, ValueError):
        pass  # absent or torn: generate
    generate_demo_corpus(folder, seed=DEMO_SEED, write_task=False, task=task)
    _write_aside(stamp, [json.dumps(expected, indent=1) + "\n"])
    return folder


def generate_command(base_dir: Path) -> str | None:
    """The one command that writes the data a task in `base_dir` is missing, when it is generated
    data: the demo preset's cache folder, or a folder `advisor data generate-demo` wrote (its
    task.yaml is demo.yaml). None for any other task: its data is the user's."""
    folder = Path(base_dir)
    demo = PRESETS_DIR / "tasks" / "demo.yaml"
    copied = folder / "task.yaml"
    is_copy = copied.is_file() and copied.read_bytes() == demo.read_bytes()
    if is_copy or folder.resolve() == generated_data_dir("demo").resolve():
        return f"{GENERATED_TASK_DATA['demo']} --out {folder}"
    return None
