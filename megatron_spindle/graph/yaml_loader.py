"""YAML for workload and cluster files: safe loading that rejects a key given twice in one mapping, and reads
exponent floats as YAML 1.2 does.

PyYAML's ``safe_load`` keeps the last of two equal keys without a word, so a typo'd copy-paste of a module or a
task setting silently replaces the first; here it is an error naming the key and both lines. PyYAML follows YAML
1.1, where ``25e9`` or ``1e-6`` (no dot, or no sign in the exponent) is a string, so a bandwidth or an epsilon
written the usual way was refused as "not a number"; here they are floats.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml


class DuplicateKeyError(yaml.constructor.ConstructorError):
    pass


class UniqueKeySafeLoader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if first is not None:
                    raise DuplicateKeyError(
                        None, None, f"duplicate key {key!r} (first given on line {first.start_mark.line + 1})",
                        key_node.start_mark)
                seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


# YAML 1.2's float forms that YAML 1.1 (PyYAML) reads as strings: an exponent without a sign, or without a dot
EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
UniqueKeySafeLoader.add_implicit_resolver("tag:yaml.org,2002:float", EXPONENT_FLOAT, list("-+0123456789."))


def load_yaml_file(path: str | Path) -> Any:
    """The document in ``path``; raises yaml.YAMLError (DuplicateKeyError for a repeated key) or OSError."""
    with open(path, encoding="utf-8") as f:
        return yaml.load(f, Loader=UniqueKeySafeLoader)  # noqa: S506 - a SafeLoader subclass


def load_yaml_as(path: str | Path, what: str, error: type[Exception]) -> Any:
    """``load_yaml_file``, with every way it fails as ``error("<what> <path>: <one line>")``."""
    try:
        return load_yaml_file(path)
    except yaml.YAMLError as e:
        raise error(f"{what} {path}: {yaml_error_text(e)}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{what} {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None


def yaml_error_text(e: yaml.YAMLError) -> str:
    """A one-line description of a YAML error (problem and line)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else " ".join(
        str(e).split())
