"""Row formats of training data, and how one row becomes token ids with a label per token.

A source's rows are in one of five formats (LLaMA-Factory's and TRL's names for them):

- ``text``: ``{"text": ...}``; continued pre-training, every token is trained;
- ``prompt_completion``: ``{"prompt": ..., "completion": ...}``; strings are concatenated as they are,
  lists of messages are rendered as a chat;
- ``chat``: ``{"messages": [{"role": ..., "content": ...}, ...], "tools": [...]}`` (OpenAI style, with
  `tool_calls` and `tool` messages), rendered by the tokenizer's chat template;
- ``alpaca``: ``{"instruction": ..., "input": ..., "output": ..., "system": ..., "history": [[q, a], ...]}``:
  earlier exchanges, then a user turn (instruction, then the input after a blank line) and the
  output as the assistant's answer;
- ``sharegpt``: ``{"conversations": [{"from": "human" | "gpt" | "system" | "function_call" |
  "observation", "value": ...}, ...], "tools": "[...]"}`` (LLaMA-Factory's tool-call shape).

Tool calls and tool results become the messages transformers' chat templates take, and a row's
tools go to the template as `tools=` (trainer/data/messages.py). Rows holding images, audio or video
are refused: training is text-only.

Field names can be overridden per source (``fields: {prompt: question}``). The loss is on the
answers only: prompt, system and user tokens carry label -100, assistant and completion tokens (and
the end-of-turn or end-of-text token that closes them) carry their own id; an assistant turn that
calls a function is an answer too. A chat is rendered incrementally: the tokens of an assistant
turn are those the template adds between the conversation before it (through the generation
prompt) and the conversation through it, so they are exactly what the template makes of that
turn, end-of-turn token included.

A source's `LossRule` changes which tokens train, as LLaMA-Factory and Axolotl do:
`train_on_prompt` every token, `mask_history` only a row's last trained turn, `roles_to_train` the
turns of other roles too (a turn's content and its end-of-turn token: its header is what the
template renders for the role with empty content).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Protocol

from specs.errors import UsageError
from trainer.data.chat_templates import TEMPLATE_NAMES
from trainer.data.messages import BadRow, chat_message, refuse_media, sharegpt_messages, text_of, tool_list
from trainer.data.sources import expand_source_path, file_type_of, read_rows

IGNORE = -100  # the label of a token that is not trained (torch's cross-entropy ignore_index)
DETECT_ROWS = 100  # rows read to detect a source's format

DEFAULT_FIELDS: dict[str, dict[str, str]] = {
    "text": {"text": "text"},
    "prompt_completion": {"prompt": "prompt", "completion": "completion"},
    "chat": {"messages": "messages", "role": "role", "content": "content", "tools": "tools"},
    "alpaca": {"instruction": "instruction", "input": "input", "output": "output", "system": "system",
               "history": "history", "tools": "tools"},
    "sharegpt": {"conversations": "conversations", "from": "from", "value": "value", "system": "system",
                 "tools": "tools", "user_tag": "human", "assistant_tag": "gpt", "system_tag": "system",
                 "function_tag": "function_call", "observation_tag": "observation"},
}
# the fields that identify a format, most structured first
SIGNATURES: dict[str, tuple[str, ...]] = {
    "chat": ("messages",), "sharegpt": ("conversations",), "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"), "text": ("text",),
}
Messages = list[dict[str, Any]]
Tools = list[dict[str, Any]] | None


@dataclass(frozen=True)
class LossRule:
    """Which tokens of a supervised row train: its answers (the default), every token
    (`train_on_prompt`), only the last trained turn (`mask_history`), or the turns of `roles`."""

    train_on_prompt: bool = False
    mask_history: bool = False
    roles: tuple[str, ...] = ("assistant",)

    @classmethod
    def of(cls, source: Any) -> "LossRule":
        """A task source's rule (specs/task.py DataSource's switches)."""
        return cls(bool(source.train_on_prompt), bool(source.mask_history),
                   tuple(source.roles_to_train or cls.roles))


ANSWERS = LossRule()


class RowTokenizer(Protocol):
    """What rendering needs of a tokenizer (trainer/corpus.py's tokenizers have it; a transformers
    tokenizer is wrapped by `row_tokenizer`)."""

    eos_token_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        ...

    def chat(self, messages: Messages, add_generation_prompt: bool, tools: Tools = None) -> list[int]:
        """The chat template's token ids for `messages` (and `tools`); a UsageError when there is no template."""
        ...

    def has_chat_template(self) -> bool:
        ...


class HFRowTokenizer:
    """A transformers tokenizer seen as a `RowTokenizer`."""

    def __init__(self, tokenizer: Any, name: str | None = None, eos_token_id: int | None = None):
        eos_token_id = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        if eos_token_id is None:
            raise UsageError(f"tokenizer {name or tokenizer.name_or_path} has no end-of-text token")
        self.hf = tokenizer
        self.eos_token_id = int(eos_token_id)
        self.name = name or str(tokenizer.name_or_path)

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def chat(self, messages: Messages, add_generation_prompt: bool, tools: Tools = None) -> list[int]:
        if not self.has_chat_template():
            raise UsageError(f"tokenizer {self.name} has no chat template: chat data needs one "
                             "(`chat_template` in its tokenizer_config.json or a chat_template.jinja), or a "
                             f"built-in: advisor train --template {'|'.join(TEMPLATE_NAMES)}")
        from jinja2 import TemplateError

        try:
            ids = self.hf.apply_chat_template(messages, tools=tools, tokenize=True,
                                              add_generation_prompt=add_generation_prompt, return_dict=False)
        except TemplateError as exc:  # templates raise on rows they do not take (several calls, roles out of order)
            raise BadRow(f"the chat template of {self.name} refuses this row: {exc}") from None
        return [int(i) for i in ids]


def row_tokenizer(tokenizer: Any) -> RowTokenizer:
    """`tokenizer` itself when it renders rows already, else a transformers tokenizer wrapped."""
    return tokenizer if hasattr(tokenizer, "chat") and hasattr(tokenizer, "encode") else HFRowTokenizer(tokenizer)


def field_names(format: str, fields: dict[str, str] | None = None) -> dict[str, str]:
    """The format's field names as the rows spell them: the defaults with `fields` applied."""
    names = dict(DEFAULT_FIELDS[format])
    names.update({k: v for k, v in (fields or {}).items() if k in names})
    return names


def formats_of(row: Any, fields: dict[str, str] | None = None) -> list[str]:
    """The formats whose identifying fields `row` has."""
    if not isinstance(row, dict):
        return []
    return [name for name, keys in SIGNATURES.items()
            if all(row.get(field_names(name, fields)[k]) is not None for k in keys)]


def detect_format(rows: Iterable[dict[str, Any]], path: str | Path, fields: dict[str, str] | None = None,
                  first_row: int = 1) -> str:
    """The one format the first rows share (at most DETECT_ROWS are read). A row that fits several
    formats, a first row that fits none, or rows of different formats, are a UsageError naming the
    file and the row (rows count from `first_row`). A later row that fits none is left to be
    rendered, which names its missing field."""
    found: tuple[str, int] | None = None
    for number, row in enumerate(rows, first_row):
        if number - first_row >= DETECT_ROWS:
            break
        kinds = formats_of(row, fields)
        if len(kinds) > 1:
            clues = ", ".join(f"{k} ({'/'.join(SIGNATURES[k])})" for k in kinds)
            raise UsageError(f"{path}, row {number}: the fields fit several formats, {clues}: set the "
                             f"source's format to one of {', '.join(kinds)}")
        if not kinds and found is not None:
            break
        if not kinds:
            seen = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
            raise UsageError(f"{path}, row {number}: no format's fields (messages, prompt/completion, "
                             f"instruction/output, conversations or text); the row has: {seen or 'nothing'}")
        if found is None:
            found = (kinds[0], number)
        elif kinds[0] != found[0]:
            raise UsageError(f"{path}, row {number}: {kinds[0]} ({'/'.join(SIGNATURES[kinds[0]])}), but row "
                             f"{found[1]} is {found[0]}: one format per source")
    if found is None:
        raise UsageError(f"{path}: no rows to detect the format from")
    return found[0]


def source_format(source: Any, base_dir: Path) -> str:
    """A task source's row format: as the task says, else detected from its first file's first rows."""
    if source.format:
        return source.format
    file_type = file_type_of(Path(base_dir), source)
    path = expand_source_path(Path(base_dir), source.path, file_type)[0]
    return detect_format(itertools.islice(read_rows(path, file_type), DETECT_ROWS), path, source.fields)


def render_example(row: dict[str, Any], format: str, tokenizer: Any, fields: dict[str, str] | None = None,
                   rule: LossRule = ANSWERS) -> tuple[list[int], list[int]]:
    """Token ids of one row and their labels: the id where the token is trained, -100 where not
    (by default prompt, system and user turns; `rule` says otherwise). Text rows and plain
    completions end with end-of-text."""
    tok = row_tokenizer(tokenizer)
    names = field_names(format, fields)
    refuse_media(row)
    if format == "text":
        ids = tok.encode(_text(row, names["text"])) + [tok.eos_token_id]
        return ids, list(ids)
    messages = _messages(row, format, names, tok)
    if messages is None:  # a plain prompt and completion: no template
        prompt, completion = _plain_pair(row, format, names)
        prompt_ids, answer = tok.encode(prompt), tok.encode(completion) + [tok.eos_token_id]
        prompt_labels = list(prompt_ids) if rule.train_on_prompt else [IGNORE] * len(prompt_ids)
        return prompt_ids + answer, prompt_labels + answer
    tools = tool_list(row.get(names["tools"]), names["tools"]) if "tools" in names else None
    return _render_chat(messages, tok, tools, rule)


def prompt_and_answer(row: dict[str, Any], format: str, tokenizer: Any,
                      fields: dict[str, str] | None = None) -> tuple[list[int], list[int]]:
    """The prompt a model is asked to continue (every token before the last answer, through the
    chat template's generation prompt) and the reference answer's tokens (its end-of-turn or
    end-of-text token included), for exact-match evaluation."""
    if format == "text":
        raise UsageError("text rows have no answer to match: evaluate prompt_completion, chat, alpaca or sharegpt data")
    ids, labels = render_example(row, format, tokenizer, fields)
    end = max(i for i, label in enumerate(labels) if label != IGNORE) + 1
    start = end
    while start > 0 and labels[start - 1] != IGNORE:
        start -= 1
    return ids[:start], ids[start:end]


# -- the formats ----------------------------------------------------------------------------------


def _field(row: dict[str, Any], name: str, kind: type = str, required: bool = True) -> Any:
    value = row.get(name) if isinstance(row, dict) else None
    if value is None:
        if required:
            raise BadRow(f"no field '{name}' (or it is null)")
        return None
    if not isinstance(value, kind):
        raise BadRow(f"field '{name}' is {type(value).__name__}, not a {'string' if kind is str else kind.__name__}")
    return value


def _text(row: dict[str, Any], name: str) -> str:
    return _field(row, name)


def _plain_pair(row: dict[str, Any], format: str, names: dict[str, str]) -> tuple[str, str]:
    """Prompt and completion as text: prompt_completion's strings, or an alpaca row for a tokenizer
    without a chat template (instruction, the input after a blank line, a blank line before the output)."""
    if format == "prompt_completion":
        return _field(row, names["prompt"]), _field(row, names["completion"])
    extra = _field(row, names["input"], required=False)
    prompt = _field(row, names["instruction"]) + (f"\n\n{extra}" if extra else "")
    return prompt + "\n\n", _field(row, names["output"])


def _messages(row: dict[str, Any], format: str, names: dict[str, str], tok: RowTokenizer) -> Messages | None:
    """The row as chat messages, or None when it is rendered as plain text (string prompt and
    completion; alpaca without a chat template)."""
    if format == "chat":
        return _message_list(_field(row, names["messages"], list), names["messages"], names["role"], names["content"])
    if format == "sharegpt":
        turns = sharegpt_messages(_field(row, names["conversations"], list), names)
        system = _field(row, names["system"], required=False)
        return ([{"role": "system", "content": system}] if system else []) + turns
    if format == "alpaca":
        if not tok.has_chat_template():
            if row.get(names["history"]):
                raise BadRow(f"field '{names['history']}' (earlier turns) needs a tokenizer with a chat template")
            return None
        prompt, output = _plain_pair(row, format, names)
        system = _field(row, names["system"], required=False)
        return ([{"role": "system", "content": system}] if system else []) + _history(row, names["history"]) + [
            {"role": "user", "content": prompt.rstrip("\n")}, {"role": "assistant", "content": output}]
    if format == "prompt_completion":
        prompt, completion = row.get(names["prompt"]), row.get(names["completion"])
        if isinstance(prompt, list) or isinstance(completion, list):  # conversational prompt and completion
            before = _message_list(prompt, names["prompt"], "role", "content") if isinstance(prompt, list) else \
                [{"role": "user", "content": _field(row, names["prompt"])}]
            after = _message_list(completion, names["completion"], "role", "content") \
                if isinstance(completion, list) else [{"role": "assistant", "content": _field(row, names["completion"])}]
            return before + after
        return None
    raise UsageError(f"unknown row format '{format}' (known: {', '.join(DEFAULT_FIELDS)})")


def _message_list(turns: Any, name: str, role: str, content: str) -> Messages:
    if not isinstance(turns, list) or not turns:
        raise BadRow(f"field '{name}' is empty or not a list")
    return [chat_message(turn, f"'{name}' turn {number}", role, content) for number, turn in enumerate(turns, 1)]


def _history(row: dict[str, Any], name: str) -> Messages:
    """Alpaca's earlier exchanges, [[instruction, answer], ...], as user and assistant turns."""
    pairs = row.get(name) or []
    if not isinstance(pairs, list):
        raise BadRow(f"field '{name}' is {type(pairs).__name__}, not a list of [instruction, answer] pairs")
    turns = []
    for number, pair in enumerate(pairs, 1):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise BadRow(f"'{name}' entry {number} is not an [instruction, answer] pair")
        turns += [{"role": "user", "content": text_of(pair[0], f"'{name}' entry {number}")},
                  {"role": "assistant", "content": text_of(pair[1], f"'{name}' entry {number}")}]
    return turns


def _check_template_shows_tools(messages: Messages, tok: RowTokenizer, tools: Tools, ids: list[int]) -> None:
    """A template that drops the tools or the calls would train answers to functions the model never
    saw, or calls as empty turns: refused (naming the first such row) rather than trained wrong."""
    if tools and tok.chat(messages, add_generation_prompt=False) == ids:
        raise BadRow("the tokenizer's chat template ignores `tools` (the rows list functions): use a template "
                     "that renders them, e.g. the model family's own tool-calling template")
    if any("tool_calls" in m for m in messages):
        bare = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
        if tok.chat(bare, add_generation_prompt=False, tools=tools) == ids:
            raise BadRow("the tokenizer's chat template ignores assistant `tool_calls` (the rows call functions): "
                         "use a template that renders them")


def _render_chat(messages: Messages, tok: RowTokenizer, tools: Tools = None,
                 rule: LossRule = ANSWERS) -> tuple[list[int], list[int]]:
    """The whole conversation through the template, each turn of the rule's roles trained (an
    assistant's function call too), or only the last of them (mask_history), or every token
    (train_on_prompt)."""
    ids = tok.chat(messages, add_generation_prompt=False, tools=tools)
    _check_template_shows_tools(messages, tok, tools, ids)
    if rule.train_on_prompt:
        return ids, list(ids)
    trained = [i for i, message in enumerate(messages) if message["role"] in rule.roles]
    if not trained:
        raise BadRow(f"no {' or '.join(rule.roles)} turn to train on")
    labels = [IGNORE] * len(ids)
    for i in trained[-1:] if rule.mask_history else trained:
        start, end = _turn_span(messages, i, tok, tools, ids)
        labels[start:end] = ids[start:end]
    return ids, labels


def _turn_span(messages: Messages, i: int, tok: RowTokenizer, tools: Tools, ids: list[int]) -> tuple[int, int]:
    """Where turn `i`'s trained tokens lie in the whole conversation's `ids`: those the template adds
    for it after its header. An assistant's header is the generation prompt; another role's is
    what the template renders for that role with empty content (the tokens it shares with the turn)."""
    through = tok.chat(messages[: i + 1], add_generation_prompt=False, tools=tools)
    if messages[i]["role"] == "assistant":
        before = tok.chat(messages[:i], add_generation_prompt=True, tools=tools) if i else []
        start = len(before) if through[: len(before)] == before else -1
    else:
        probe = tok.chat(messages[:i] + [{"role": messages[i]["role"], "content": ""}], add_generation_prompt=False,
                         tools=tools)
        start = next((n for n, (a, b) in enumerate(zip(probe, through)) if a != b), min(len(probe), len(through)))
    if start < 0 or ids[: len(through)] != through:
        raise UsageError("the tokenizer's chat template does not render a conversation as the sum of its "
                         "turns (an earlier turn changes when a later one is added): its answers cannot be "
                         "told apart; use a template that renders turns in order")
    return start, len(through)
