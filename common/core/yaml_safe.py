"""The config's YAML reader: a config file, or one `--set` value, as plain values.

Plain PyYAML would hang or end in a traceback on hostile input, or keep a mistake silently; this reader
refuses, in one line that names the file (or `--set KEY`) and the line:
- a key given twice in one mapping (plain YAML keeps the last), and a key that is not a scalar (`? [a, b]`);
- more than MAX_CONFIG_VALUES values once the aliases are expanded (an alias bomb, "billion laughs");
- nesting deeper than MAX_CONFIG_DEPTH, written out (PyYAML composes recursively: a RecursionError) or
  through aliases, and an alias inside its own anchor (a value that contains itself).
Anchors, aliases and merge keys (`<<: *defaults`) work as YAML says.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from common.core.errors import ConfigError

MAX_CONFIG_VALUES = 100_000  # a config has a few hundred; far more is an alias bomb ("billion laughs")
MAX_CONFIG_DEPTH = 64  # a config nests a few levels (section, key, a JSON value in extra_body); deeper is hostile


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last silently)
    and a key that is not a scalar (`? [a, b]`); merge keys (`<<: *defaults`) work, their keys
    overridable as YAML says. Nesting deeper than MAX_CONFIG_DEPTH is refused while composing."""

    def __init__(self, text: str, name: str):
        super().__init__(text)
        self.name = name  # named in the errors: the file's path, or "--set KEY"
        self.depth = 0

    def compose_node(self, parent, index):
        # PyYAML composes recursively: 50,000 nested brackets would be a RecursionError traceback
        if self.depth >= MAX_CONFIG_DEPTH:
            line = self.peek_event().start_mark.line + 1
            raise ConfigError(f"{self.name}, line {line}: the YAML is nested more than {MAX_CONFIG_DEPTH} levels deep; "
                              f"a config nests a few: flatten it")
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                raise ConfigError(f"{self.name}, line {key_node.start_mark.line + 1}: a config key must be a plain name, "
                                  f"got a {key_node.id} (a YAML complex key, `? ...`); write it as `name: value`")
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(
                    f"config key '{key}' appears twice in one section of {self.name} (lines {seen[key] + 1} and "
                    f"{key_node.start_mark.line + 1}); keep one of them"
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _children(node) -> list:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _expanded_shape(root, what: str) -> tuple[int, int]:
    """(values, depth) the YAML node stands for once its aliases are expanded. Each shared node is counted
    once per use and computed once: linear in the document, whatever the expansion; without recursion, as a
    chain of aliases nests deeper than Python's stack. A node that contains itself is refused."""
    shape: dict[int, tuple[int, int]] = {}
    open_ids: set[int] = set()  # the nodes being walked: the current node's ancestors
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        kids = _children(node)
        if children_done:
            open_ids.discard(id(node))
            shape[id(node)] = (1 + sum(shape[id(k)][0] for k in kids), 1 + max((shape[id(k)][1] for k in kids), default=0))
            continue
        if id(node) in shape:
            continue  # shared: already walked from another use
        open_ids.add(id(node))
        for kid in kids:
            if id(kid) in open_ids:
                raise ConfigError(f"{what}, line {kid.start_mark.line + 1}: a YAML alias (*name) inside its own anchor "
                                  f"makes a value that contains itself; a config cannot hold one: remove the alias")
        stack.append((node, True))
        stack.extend((kid, False) for kid in kids)
    return shape[id(root)]


def _safe_yaml(text: str, name: str, what: str) -> Any:
    """YAML text as plain values (a config file, or a --set value), refusing what would hang or end in a
    traceback: more than MAX_CONFIG_VALUES values once the aliases are expanded (an alias bomb), nesting deeper
    than MAX_CONFIG_DEPTH (written out or through aliases), a value that contains itself, a key given twice."""
    loader = _UniqueKeyLoader(text, name)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        values, depth = _expanded_shape(node, what)
        if values > MAX_CONFIG_VALUES:
            raise ConfigError(f"{what} expands to more than {MAX_CONFIG_VALUES:,} values through its YAML aliases (*name); "
                              f"a config needs a few hundred: remove the aliases that multiply")
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"{what} nests more than {MAX_CONFIG_DEPTH} levels deep through its YAML aliases (*name); "
                              f"a config nests a few: remove the aliases that nest")
        return loader.construct_document(node)
    finally:
        loader.dispose()


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _UniqueKeyLoader.construct_mapping)


def read_yaml_file(path: Path) -> Any:
    """A config file's YAML as plain values (None for an empty file)."""
    try:
        return _safe_yaml(path.read_text(encoding="utf-8"), str(path), f"config file {path}")
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}".replace("\n", " ")) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text ({e}); save it as UTF-8") from None


_EXPONENT_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def yaml_value(text: str, name: str) -> Any:
    """One value written as YAML (`null`, `[1,2]`, `0.5`), read as the file is (an alias bomb or deep nesting
    is refused the same way); text that is not YAML stays text, and exponent numbers without a dot (`1e-4`),
    which YAML 1.1 reads as strings, are floats. name: what the errors call it, e.g. "--set train.lr"."""
    try:
        value = _safe_yaml(text, name, name) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()):
        value = float(value)
    return value
