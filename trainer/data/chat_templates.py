"""Built-in chat templates for tokenizers that ship none (`advisor train --template NAME`).

A base model's tokenizer often has no `chat_template`, yet chat, sharegpt and conversational rows
need one to become tokens and answer-only labels. These render each family's published turn
layout (its special tokens, role names and end-of-turn markers); they are written here from those
facts. Tool definitions and tool calls are not rendered: rows with them are refused by the check
in trainer/data/formats.py, as for any template that drops them.

A template is only as good as the tokenizer's vocabulary: each of its special tokens must be one
token there, or the layout the model learns is not the family's (`check_special_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specs.errors import UsageError


@dataclass(frozen=True)
class ChatTemplate:
    family: str
    jinja: str
    special_tokens: tuple[str, ...]  # each must be a single token of the tokenizer


# Llama 3: a header per turn, its content stripped, <|eot_id|> closing it.
_LLAMA3 = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + (message['content'] or '') | trim"
    " + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)
# ChatML, as Qwen2 and Qwen2.5 use it: <|im_start|>role, newline, content, <|im_end|>, newline.
_CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Mistral (v0.1/v0.2 instruct): [INST] user [/INST] then the answer closed by </s>; no system role,
# so a system message opens the next user turn.
_MISTRAL = (
    "{%- set ns = namespace(system='') -%}"
    "{{- '<s>' -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = message['content'] + '\\n\\n' -%}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '[INST] ' + ns.system + message['content'] + ' [/INST]' -}}{%- set ns.system = '' -%}"
    "{%- elif message['role'] == 'assistant' -%}{{- (message['content'] or '') + '</s>' -}}"
    "{%- else -%}{{- raise_exception('the mistral template takes system, user and assistant turns') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
# Gemma: <start_of_turn>user / model ... <end_of_turn>; no system role, so a system message opens
# the next user turn.
_GEMMA = (
    "{%- set ns = namespace(system='') -%}"
    "{{- '<bos>' -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = message['content'] + '\\n\\n' -%}"
    "{%- elif message['role'] in ('user', 'assistant') -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{{- '<start_of_turn>' + role + '\\n' + ns.system + (message['content'] or '') | trim + '<end_of_turn>\\n' -}}"
    "{%- set ns.system = '' -%}"
    "{%- else -%}{{- raise_exception('the gemma template takes system, user and assistant turns') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)
# Phi-3: <|role|>, newline, content, <|end|>, newline.
_PHI3 = (
    "{%- for message in messages -%}"
    "{%- if message['role'] in ('system', 'user', 'assistant') -%}"
    "{{- '<|' + message['role'] + '|>\\n' + (message['content'] or '') + '<|end|>\\n' -}}"
    "{%- else -%}{{- raise_exception('the phi3 template takes system, user and assistant turns') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

BUILTIN_TEMPLATES: dict[str, ChatTemplate] = {
    "llama3": ChatTemplate("Llama 3", _LLAMA3,
                           ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    "qwen2.5": ChatTemplate("Qwen2.5 (ChatML)", _CHATML, ("<|im_start|>", "<|im_end|>")),
    "mistral": ChatTemplate("Mistral", _MISTRAL, ("<s>", "</s>")),
    "gemma": ChatTemplate("Gemma", _GEMMA, ("<bos>", "<start_of_turn>", "<end_of_turn>")),
    "phi3": ChatTemplate("Phi-3", _PHI3, ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")),
}
TEMPLATE_NAMES = tuple(BUILTIN_TEMPLATES)


def builtin_template(name: str) -> ChatTemplate:
    """The built-in template called `name`; a UsageError naming the choices otherwise."""
    if name not in BUILTIN_TEMPLATES:
        raise UsageError(f"--template {name}: choose one of {', '.join(TEMPLATE_NAMES)}")
    return BUILTIN_TEMPLATES[name]


def check_special_tokens(tokenizer: Any, name: str, where: str) -> None:
    """Refuse a tokenizer that does not encode each of the template's special tokens as one token."""
    missing = [token for token in builtin_template(name).special_tokens
               if len(tokenizer(token, add_special_tokens=False)["input_ids"]) != 1
               or tokenizer.convert_tokens_to_ids(token) in (None, tokenizer.unk_token_id)]
    if missing:
        raise UsageError(f"--template {name}: tokenizer {where} has no single token for {', '.join(missing)} "
                         f"(the {builtin_template(name).family} layout needs them): use the family's tokenizer")


def use_builtin_template(tokenizer: Any, name: str, where: str) -> Any:
    """`tokenizer` with the built-in template `name` as its chat template (it replaces the
    tokenizer's own: the flag is an explicit choice)."""
    check_special_tokens(tokenizer, name, where)
    tokenizer.chat_template = builtin_template(name).jinja
    return tokenizer
