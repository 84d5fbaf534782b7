"""The text the shipped demo-tiny tokenizer (presets/tokenizers/demo-tiny) was trained on.

The tokenizer was trained on the demo corpus of generator version 2: the grammar's paragraphs,
multi-step arithmetic with worked steps, and string-manipulation instructions. The demo's skills
have changed since (trainer/data/demo_corpus.py), but the tokenizer stays as shipped: these
generators rebuild its training text byte for byte (`trainer.data.tokenizer.train_demo_tokenizer`).
"""

from __future__ import annotations

import random
from typing import Callable, Iterator

from trainer.data.demo_corpus import ADJECTIVES, NOUNS, PLACES, PREPOSITIONS, _clause, language_document

# --- arithmetic with worked steps -----------------------------------------------------------------------------

def arithmetic_problem(rng: random.Random, steps: int) -> dict:
    """`steps` operations applied left to right, with the worked steps in the answer."""
    top = (999, 500, 200, 100)[min(steps, 4) - 1]
    value = rng.randint(2, top)
    expression = str(value)
    worked = []
    for _ in range(steps):
        op = rng.choice("+-*") if steps > 1 else rng.choice("+-")
        operand = rng.randint(2, 9) if op == "*" else rng.randint(2, top)
        if op == "-" and operand > value:
            op = "+"
        result = value + operand if op == "+" else value - operand if op == "-" else value * operand
        worked.append(f"{value}{op}{operand}={result}.")
        expression = f"({expression}){op}{operand}" if len(worked) > 1 else f"{expression}{op}{operand}"
        value = result
    prompt = f"Q: {expression}=? A:"
    completion = f" {value}" if steps == 1 else f" {' '.join(worked)} The answer is {value}."
    return {"text": prompt + completion, "prompt": prompt, "completion": completion, "steps": steps}


def arithmetic_document(rng: random.Random) -> dict:
    return arithmetic_problem(rng, rng.choices((1, 2, 3, 4), weights=(4, 3, 2, 1))[0])


# --- instruction following ----------------------------------------------------------------------------

def _phrase(rng: random.Random) -> str:
    """Mostly three or four words, so that instructions rarely repeat exactly."""
    size = rng.choices((1, 2, 3, 4), weights=(1, 3, 4, 2))[0]
    if size == 1:
        return rng.choice(NOUNS + ADJECTIVES + PLACES)
    words = [rng.choice(ADJECTIVES) for _ in range(size - 1)] + [rng.choice(NOUNS)]
    if size == 4 and rng.random() < 0.5:
        words = [rng.choice(ADJECTIVES), rng.choice(NOUNS), rng.choice(PREPOSITIONS), rng.choice(PLACES)]
    return " ".join(words)


def instruction_document(rng: random.Random) -> dict:
    kind = rng.choice(("reverse", "uppercase", "count", "first_letters", "sort", "repeat"))
    phrase = _phrase(rng)
    noun = "word" if " " not in phrase else "text"
    if kind == "reverse":
        instruction, response = f"reverse the {noun} '{phrase}'.", phrase[::-1]
    elif kind == "uppercase":
        instruction, response = f"write '{phrase}' in uppercase.", phrase.upper()
    elif kind == "count":
        letter = rng.choice(phrase.replace(" ", ""))
        instruction, response = f"count the letter '{letter}' in '{phrase}'.", str(phrase.count(letter))
    elif kind == "first_letters":
        sentence_words = _clause(rng, past=False).split()
        phrase = " ".join(sentence_words)
        instruction, response = f"give the first letter of each word in '{phrase}'.", "".join(w[0] for w in sentence_words)
    elif kind == "sort":
        items = rng.sample(NOUNS, rng.randint(3, 6))
        instruction, response = f"sort the words '{' '.join(items)}' alphabetically.", " ".join(sorted(items))
    else:
        times = rng.randint(2, 4)
        instruction = f"repeat the {noun} '{phrase}' {('two', 'three', 'four')[times - 2]} times."
        response = " ".join([phrase] * times)
    prompt, completion = f"Instruction: {instruction}\nResponse:", f" {response}"
    return {"text": prompt + completion, "prompt": prompt, "completion": completion, "kind": kind}


# --- the training text ---------------------------------------------------------------------------

# (generator, random stream salt, documents): the salts and counts of the version-2 corpus files
# language.jsonl, arithmetic.jsonl and instructions.jsonl
TOKENIZER_TRAINING_DOCUMENTS: list[tuple[Callable[[random.Random], dict], int, int]] = [
    (language_document, 1, 8_900), (arithmetic_document, 3, 9_200), (instruction_document, 5, 6_125)]


def tokenizer_training_texts(seed: int = 0) -> Iterator[str]:
    for generator, salt, count in TOKENIZER_TRAINING_DOCUMENTS:
        rng = random.Random(seed * 1_000_003 + salt)
        for _ in range(count):
            yield generator(rng)["text"]
