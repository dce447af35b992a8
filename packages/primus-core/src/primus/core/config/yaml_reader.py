"""The YAML reader of config files and command-line values: PyYAML's SafeLoader with the limits a config needs.

A config is a few hundred keys. What a hostile or broken file can do to a plain SafeLoader, and what is refused
here instead, each as one :class:`YAMLRefused` naming the line:

- an anchor / alias bomb (``b: [*a, *a, ...]`` nested a few levels) is a tiny file whose expansion has billions of
  nodes; every later walk of it (environment substitution, merging, validation) expands it. The composed document
  is measured with each alias expanded (a walk that visits every node once) and refused above :data:`MAX_NODES`
  nodes, before anything is built from it; so is an alias to a node that contains it (a cycle).
- nesting deeper than :data:`MAX_DEPTH` (aliases expanded) would exhaust Python's recursion (PyYAML composes
  recursively); it is refused while composing, at the first level past the limit.
- a key given twice in one mapping, which PyYAML resolves by keeping the last silently; ``<<`` merge keys are not
  duplicates (an explicit key overrides a merged one by design).
"""

from __future__ import annotations

import re

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

#: Nodes of a document with every alias expanded (a large config has about a thousand).
MAX_NODES = 100_000
#: Nesting levels of a document (a config nests four or five).
MAX_DEPTH = 64

_MERGE = "tag:yaml.org,2002:merge"


class YAMLRefused(yaml.YAMLError):
    """A document the reader will not build; the message is one line, with the line number."""


class Loader(yaml.SafeLoader):
    """SafeLoader (no object construction) with the limits above, that reads ``3e-4`` as a float (YAML 1.2)."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise YAMLRefused(f"line {mark.line + 1}: nested deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        seen: dict[tuple[str, str], int] = {}
        for key, _ in node.value:
            if isinstance(key, ScalarNode) and key.tag != _MERGE:
                line = key.start_mark.line + 1
                if (key.tag, key.value) in seen:
                    first = seen[key.tag, key.value]
                    raise YAMLRefused(f"key {key.value!r} is given twice: line {first} and line {line}")
                seen[key.tag, key.value] = line
        return node

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None:
            _measure(node)
        return node


def _measure(root: Node) -> None:
    """Refuse ``root`` if, aliases expanded, it has more than :data:`MAX_NODES` nodes, nests deeper than
    :data:`MAX_DEPTH` or holds itself. Each distinct node is visited once (its size and depth remembered), so a
    bomb is measured in the time of its few distinct nodes."""
    sizes: dict[int, tuple[int, int]] = {}
    active: set[int] = set()

    def visit(node: Node) -> tuple[int, int]:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise YAMLRefused(f"line {node.start_mark.line + 1}: an alias refers to a node that contains it")
        if isinstance(node, SequenceNode):
            children = list(node.value)
        elif isinstance(node, MappingNode):
            children = [part for pair in node.value for part in pair]
        else:
            sizes[key] = (1, 1)
            return sizes[key]
        active.add(key)
        size, depth = 1, 1
        for child in children:
            child_size, child_depth = visit(child)
            size, depth = size + child_size, max(depth, child_depth + 1)
            if size > MAX_NODES:
                raise YAMLRefused(
                    f"line {node.start_mark.line + 1}: expands to more than {MAX_NODES:,} values "
                    "(anchors and aliases expanded); a config is far smaller"
                )
            if depth > MAX_DEPTH:
                raise YAMLRefused(
                    f"line {node.start_mark.line + 1}: nested deeper than {MAX_DEPTH} levels (aliases expanded)"
                )
        active.discard(key)
        sizes[key] = (size, depth)
        return sizes[key]

    visit(root)


Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)
