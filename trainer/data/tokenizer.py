"""Tokenizers for data preparation: the task's (a local folder or file), or the one a model preset ships.

Nothing is fetched from a hub. demo-tiny ships its own: a byte-level BPE of 2,048 tokens (the
model's vocab_size) trained with `tokenizers` on the generated demo curriculum. Byte-level means
any text encodes (no unknown token), and BPE merges make the demo's words one or two tokens, so a
2,048-token vocabulary covers the demo with short sequences — a plain byte tokenizer would need
256 ids but make every sequence 4 to 5 times longer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from specs.errors import UsageError
from specs.remote_code import refuse_remote_code
from presets import PRESETS_DIR
from trainer.data.demo_tokenizer_corpus import tokenizer_training_texts

TOKENIZERS_DIR = PRESETS_DIR / "tokenizers"
DEMO_VOCAB_SIZE = 2048
EOS, PAD = "<|endoftext|>", "<|pad|>"


def load_tokenizer(path: Path, trusted: bool = False) -> Any:
    """A transformers fast tokenizer from a folder (tokenizer.json, or any files AutoTokenizer
    reads) or from a tokenizer.json file; local files only. A folder naming Python code of its own
    (`auto_map`) is refused unless `trusted` (--trust-remote-code), which runs that code."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    if path.is_file():
        folder, file = path.parent, path
    elif path.is_dir():
        folder, file = path, path / "tokenizer.json"
    else:
        raise UsageError(f"tokenizer not found: {path}")
    try:
        refuse_remote_code(folder, "tokenizer_config.json", "tokenizer", trusted)
        if (folder / "tokenizer_config.json").is_file() or not file.is_file():
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=trusted)
        return PreTrainedTokenizerFast(tokenizer_file=str(file))
    except UsageError:
        raise
    except Exception as exc:  # transformers raises many types for a broken folder
        raise UsageError(f"cannot load tokenizer from {path}: {type(exc).__name__}: {exc}") from None


class TextTokenizer:
    """What data preparation needs of a tokenizer: batch encoding without special tokens, the
    end-of-text id and the vocabulary size.

    A folder with a `tokenizer.json` is read straight by `tokenizers` (the same file transformers'
    fast tokenizers wrap), which skips importing transformers and torch; anything else goes
    through `AutoTokenizer` (local files only)."""

    def __init__(self, path: Path, trusted: bool = False) -> None:
        path = Path(path)
        file = path if path.is_file() else path / "tokenizer.json"
        self.path = path
        self._fast = None
        self._hf = None
        if file.is_file():
            from tokenizers import Tokenizer

            try:
                self._fast = Tokenizer.from_file(str(file))
            except Exception as exc:
                raise UsageError(f"cannot load tokenizer {file}: {exc}") from None
            self.vocab_size = self._fast.get_vocab_size(with_added_tokens=True)
            self.eos_id = self._find_eos(file.parent)
        else:
            self._hf = load_tokenizer(path, trusted)
            self.vocab_size = len(self._hf)
            self.eos_id = self._hf.eos_token_id

    def _find_eos(self, folder: Path) -> int | None:
        assert self._fast is not None
        names = []
        config = folder / "tokenizer_config.json"
        if config.is_file():
            try:
                token = json.loads(config.read_text()).get("eos_token")
            except (OSError, ValueError):
                token = None
            if isinstance(token, dict):
                token = token.get("content")
            if isinstance(token, str):
                names.append(token)
        names += [EOS, "</s>", "<eos>", "<|end_of_text|>"]
        for name in names:
            token_id = self._fast.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch_fast(texts, add_special_tokens=False)]
        return self._hf(texts, add_special_tokens=False)["input_ids"]  # type: ignore[misc]


def resolve_tokenizer_path(tokenizer: str | None, model: str | None, base_dir: Path) -> Path:
    """The task's `data.tokenizer`, else the tokenizer shipped for the task's model preset, else a
    tokenizer inside the model folder; a clear error when there is none."""
    if tokenizer:
        path = Path(tokenizer)
        return path if path.is_absolute() else base_dir / path
    if model:
        shipped = TOKENIZERS_DIR / model
        if (shipped / "tokenizer.json").is_file():
            return shipped
        folder = Path(model) if Path(model).is_absolute() else base_dir / model
        if folder.is_file():
            folder = folder.parent
        if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
            return folder
    raise UsageError("no tokenizer for this task: set `data: {tokenizer: path/to/tokenizer-folder}` in the task "
                     f"file (local files only; shipped: {', '.join(shipped_tokenizers()) or 'none'})")


def shipped_tokenizers() -> list[str]:
    return sorted(p.name for p in TOKENIZERS_DIR.glob("*") if (p / "tokenizer.json").is_file())


def load_demo_tokenizer() -> Any:
    """The demo-tiny tokenizer (presets/tokenizers/demo-tiny) as a transformers PreTrainedTokenizerFast."""
    return load_tokenizer(TOKENIZERS_DIR / "demo-tiny")


def _demo_training_texts(seed: int) -> Iterator[str]:
    return tokenizer_training_texts(seed)


def train_demo_tokenizer(out_dir: Path = TOKENIZERS_DIR / "demo-tiny", seed: int = 0) -> Path:
    """Train the byte-level BPE on the generated demo corpus and write tokenizer.json and
    tokenizer_config.json (what ships in presets/tokenizers/demo-tiny)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=DEMO_VOCAB_SIZE, min_frequency=2, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tok.train_from_iterator(_demo_training_texts(seed), trainer)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1024, "bos_token": EOS,
              "eos_token": EOS, "pad_token": PAD, "unk_token": None, "clean_up_tokenization_spaces": False,
              "add_prefix_space": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out_dir


if __name__ == "__main__":  # python -m trainer.data.tokenizer: rebuild the shipped demo tokenizer
    print(train_demo_tokenizer())
