"""Reading a YAML file a user wrote (plan, task, hardware), bounded before any validation sees it.

YAML aliases let a file of a few hundred bytes stand for billions of values ("billion laughs":
nine anchors of nine aliases each); PyYAML builds the shared objects cheaply, but every walk over
them afterwards (pydantic, the finite-number check, a JSON dump) pays the expanded size. So the
file's size is capped and the values that aliases add are counted while the document is composed:
past `MAX_ALIASED_VALUES` the file is refused in one line, before anything else reads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, SequenceNode

from advisor.errors import UsageError

MAX_YAML_BYTES = 4 * 1024**2
# Values that aliases may add beyond those written out: room for anchors reused by hand (a shared
# filter block in each stage), far below what makes validation slow (it walks ~1e6 values a second).
MAX_ALIASED_VALUES = 10_000


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, counting the values each alias stands for."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._weights: dict[int, int] = {}  # id(node) -> values under it, aliases expanded
        self._aliased = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        if self.check_event(AliasEvent):
            event = self.peek_event()
            node = super().compose_node(parent, index)
            weight = self._weights.get(id(node))
            if weight is None:  # the anchor is still open: the alias points into itself
                raise UsageError(f"recursive YAML alias *{event.anchor}")
            self._aliased += weight
            if self._aliased > MAX_ALIASED_VALUES:
                raise UsageError(f"YAML aliases expand to more than {MAX_ALIASED_VALUES:,} values (an alias bomb?); "
                                 "write the values out")
            return node
        node = super().compose_node(parent, index)
        self._weights[id(node)] = 1 + sum(self._weights.get(id(child), 1) for child in _children(node))
        return node


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def parse_user_yaml(text: str, what: str) -> Any:
    """The document in `text`, or one UsageError line naming `what` (a file, in words)."""
    if len(text) > MAX_YAML_BYTES:
        raise UsageError(f"{what} is larger than {MAX_YAML_BYTES // 1024**2} MiB")
    loader = None
    try:
        loader = _BoundedLoader(text)  # its reader refuses non-printable characters already
        return loader.get_single_data()
    except UsageError as exc:
        raise UsageError(f"{what}: {exc}") from None
    except (ValueError, yaml.YAMLError) as exc:
        raise UsageError(f"{what} is not valid YAML: {exc}") from None
    except RecursionError:  # thousands of nested brackets
        raise UsageError(f"{what} nests too deep") from None
    finally:
        if loader is not None:
            loader.dispose()


def read_user_yaml(path: Path, what: str) -> Any:
    """Read and parse a user's YAML file: at most MAX_YAML_BYTES of UTF-8, aliases bounded.
    Raises FileNotFoundError for a missing file (callers word that themselves), else UsageError."""
    try:
        size = path.stat().st_size
        if size > MAX_YAML_BYTES:
            raise UsageError(f"{what} is {size / 1024**2:.1f} MiB, larger than {MAX_YAML_BYTES // 1024**2} MiB")
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise
    except UnicodeDecodeError as exc:
        raise UsageError(f"{what} is not UTF-8 text: {exc}") from None
    except OSError as exc:
        raise UsageError(f"cannot read {what}: {exc.strerror or exc}") from None
    return parse_user_yaml(text, what)
