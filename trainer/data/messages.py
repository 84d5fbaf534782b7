"""Rows' turns as the chat messages transformers' `apply_chat_template` takes, tool calls included.

- OpenAI style: ``{"role": "assistant", "content": null, "tool_calls": [{"type": "function",
  "function": {"name": ..., "arguments": "{...}"}}]}`` and ``{"role": "tool", "content": ...}``;
- LLaMA-Factory's sharegpt: ``{"from": "function_call", "value": "{\\"name\\": ..., \\"arguments\\": ...}"}``
  turns become assistant messages with `tool_calls`, ``observation`` turns become `tool` messages;
- a row's ``tools`` (a list, or a JSON string of one as LLaMA-Factory stores it) become the
  template's `tools=`, each function wrapped as ``{"type": "function", "function": {...}}``.

Tool-call arguments are handed to the template as a dict (a JSON string is parsed): chat templates
serialise them themselves. Content given as a list of text parts is joined without a separator, as
chat templates that take parts render them. Images, audio and video are refused, never flattened
into text: training is text-only.
"""

from __future__ import annotations

import json
from typing import Any

from specs.errors import UsageError

MEDIA_FIELDS = ("images", "image", "videos", "video", "audios", "audio")
MEDIA_PARTS = {"image", "image_url", "input_image", "video", "video_url", "audio", "input_audio", "audio_url"}
PASSED_THROUGH = ("tool_call_id", "name")  # a tool message's link to its call, kept for templates that show it
SHAREGPT_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                    "system": "system", "function_call": "function_call", "observation": "tool", "tool": "tool"}


class BadRow(UsageError):
    """A row that does not fit its format; the reader adds the file and the row."""


def refuse_media(row: dict[str, Any]) -> None:
    """A row holding images, audio or video (a non-empty media field) is refused: training is text-only."""
    for name in MEDIA_FIELDS:
        if row.get(name) not in (None, "", [], {}):
            raise BadRow(f"field '{name}' holds media: training here is text-only; drop the column (or these "
                         "rows) rather than train on the text around it")


def chat_message(turn: Any, where: str, role: str = "role", content: str = "content") -> dict[str, Any]:
    """One OpenAI-style turn checked and normalised: content a string (text parts joined), tool
    calls normalised, a tool message's id and name kept. `where` names the turn in errors."""
    if not isinstance(turn, dict):
        raise BadRow(f"{where} is {type(turn).__name__}, not an object")
    if not isinstance(turn.get(role), str):
        raise BadRow(f"{where}: no field '{role}' (or it is not a string)")
    message: dict[str, Any] = {"role": turn[role]}
    calls = turn.get("tool_calls")
    if calls not in (None, []):
        if not isinstance(calls, list):
            raise BadRow(f"{where}: 'tool_calls' is {type(calls).__name__}, not a list")
        message["tool_calls"] = [tool_call(call, f"{where} tool call {n}") for n, call in enumerate(calls, 1)]
    value = turn.get(content)
    if value is None and "tool_calls" in message:
        value = ""  # a turn that only calls tools
    message["content"] = text_of(value, where, content)
    message.update({key: turn[key] for key in PASSED_THROUGH if isinstance(turn.get(key), str)})
    return message


def text_of(value: Any, where: str, content: str = "content") -> str:
    """A turn's content as one string: a string, or a list of text parts (strings or
    {"type": "text", "text": ...}) joined; a media part is refused."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise BadRow(f"{where}: no field '{content}' (or it is not a string)")
    texts = []
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(part, str):
            texts.append(part)
        elif kind in MEDIA_PARTS:
            raise BadRow(f"{where}: '{content}' has a {kind} part: training here is text-only")
        elif isinstance(part, dict) and isinstance(part.get("text"), str) and kind in (None, "text", "input_text"):
            texts.append(part["text"])
        else:
            raise BadRow(f"{where}: '{content}' has a part that is not text ({json.dumps(part)[:80]})")
    return "".join(texts)


def tool_call(call: Any, where: str) -> dict[str, Any]:
    """An OpenAI tool call ({"type": "function", "function": {...}}) or LLaMA-Factory's bare
    {"name": ..., "arguments": ...}, as {"type": "function", "function": {"name", "arguments": dict}}."""
    if not isinstance(call, dict):
        raise BadRow(f"{where} is {type(call).__name__}, not an object")
    function = call.get("function", call)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRow(f"{where}: no function name")
    out: dict[str, Any] = {"type": "function",
                           "function": {"name": function["name"], "arguments": _arguments(function, where)}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _arguments(function: dict[str, Any], where: str) -> dict[str, Any]:
    value = function.get("arguments", function.get("parameters"))
    if value in (None, ""):
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise BadRow(f"{where}: its arguments are not JSON ({value[:60]!r})") from None
    if not isinstance(value, dict):
        raise BadRow(f"{where}: its arguments are {type(value).__name__}, not an object")
    return value


def tool_list(value: Any, name: str) -> list[dict[str, Any]] | None:
    """A row's tools for the template's `tools=`: None when it has none."""
    if value in (None, "", []):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise BadRow(f"field '{name}' is a string but not JSON: it should list the functions") from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise BadRow(f"field '{name}' should be a list of function descriptions")
    return [t if isinstance(t.get("function"), dict) else {"type": "function", "function": t} for t in value] or None


def sharegpt_messages(turns: Any, names: dict[str, str]) -> list[dict[str, Any]]:
    """ShareGPT turns as messages: the role tags (`user_tag`, `assistant_tag`, `system_tag`,
    `function_tag`, `observation_tag`, with the usual names also known) mapped to roles; a function
    call's value (JSON: one call or a list) becomes the assistant's `tool_calls`."""
    field = names["conversations"]
    if not isinstance(turns, list) or not turns:
        raise BadRow(f"field '{field}' is empty or not a list")
    roles = {**SHAREGPT_ALIASES, names["user_tag"]: "user", names["assistant_tag"]: "assistant",
             names["system_tag"]: "system", names["function_tag"]: "function_call", names["observation_tag"]: "tool"}
    messages = []
    for number, turn in enumerate(turns, 1):
        where = f"'{field}' turn {number}"
        message = chat_message(turn, where, *_turn_keys(turn, names))
        role = roles.get(message["role"])
        if role is None:
            raise BadRow(f"'{field}' has a turn from '{message['role']}' (known: {', '.join(roles)})")
        if role == "function_call":
            messages.append({"role": "assistant", "content": "",
                             "tool_calls": _calls_in(message["content"], where)})
        else:
            messages.append({**message, "role": role})
    return messages


def _turn_keys(turn: Any, names: dict[str, str]) -> tuple[str, str]:
    """The keys of a turn's role and content: the source's (`from`/`value` by default), or OpenAI's
    `role`/`content` for a turn that has those instead (Axolotl's conversations often do)."""
    if isinstance(turn, dict) and names["from"] not in turn and "role" in turn:
        return "role", "content"
    return names["from"], names["value"]


def _calls_in(value: str, where: str) -> list[dict[str, Any]]:
    try:
        calls = json.loads(value)
    except ValueError:
        raise BadRow(f"{where}: a function call that is not JSON ({value[:60]!r})") from None
    calls = calls if isinstance(calls, list) else [calls]
    return [tool_call(call, f"{where} call {n}") for n, call in enumerate(calls, 1)]
