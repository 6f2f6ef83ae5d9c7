"""YAML files read as plain data, not as all of YAML: the agent's config file and the web
configuration file (:mod:`mrc_agent.exporters.exposition.http.webconfig`).

Anchors and aliases are refused (a few hundred bytes of nested aliases, a "billion laughs",
stand for billions of items once an error message or a ``str()`` walks them); a value that
cannot be built (an integer too long for Python, a date that is no date) is refused with its
line; the file is read bounded and without blocking (:mod:`mrc_agent.exporters.files`). Every
failure is one :class:`~mrc_agent.exporters.settings.ConfigError` line.
"""

from __future__ import annotations

from typing import Any

import yaml

from mrc_agent.exporters.files import describe, read_bounded
from mrc_agent.exporters.settings import SHOWN_CHARS, ConfigError, clipped, shown

#: A config file is a few dozen settings; more than this is not a config file.
MAX_CONFIG_BYTES = 1 << 20


class YAMLRefused(yaml.MarkedYAMLError):
    """Valid YAML that :class:`PlainLoader` does not take; its ``problem`` is shown."""


class PlainLoader(yaml.SafeLoader):
    """``yaml.safe_load`` without anchors and aliases, whose values are constructed or refused
    with a mark: an integer too long for Python, a date that is no date (``2024-13-45``)."""

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event = self.peek_event()
        # An alias event, or a node event carrying an anchor: refused before anything refers
        # to anything, so no value here is ever shared, let alone shared a billion times.
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise YAMLRefused(None, None, "anchors and aliases are not allowed",
                              event.start_mark)
        return super().compose_node(parent, index)  # type: ignore[no-any-return]

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as exc:
            raise YAMLRefused(None, None, f"cannot read {shown(node.value)} "
                              f"({clipped(str(exc), SHOWN_CHARS)})", node.start_mark) from exc


def load_yaml_mapping(path: str, what: str, holds: str,
                      loader: type[yaml.SafeLoader] = PlainLoader) -> dict[Any, Any]:
    """The mapping in the YAML file ``path`` (``{}`` when empty), plain data only: read bounded
    and without blocking, UTF-8, by :class:`PlainLoader` or a subclass. Every failure is one
    :class:`ConfigError` line naming ``what`` and ``path`` (the line, for a YAML error; the
    problem, for :class:`YAMLRefused` or a key given twice to a loader that refuses that);
    ``holds`` says what the mapping should have been."""
    where = f"{what} {path}"
    try:
        text = read_bounded(path, MAX_CONFIG_BYTES, what).decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {where}: {describe(exc)}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where} is not UTF-8 text") from exc
    try:
        data = yaml.load(text, Loader=loader)  # a SafeLoader or a subclass: plain data only
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None)
        why = (f": {clipped(str(problem))}" if problem and (
            isinstance(exc, YAMLRefused) or "twice" in str(problem)) else "")
        raise ConfigError(f"{where}{at} is not valid YAML{why}") from exc
    except (ValueError, OverflowError) as exc:  # a value a loader of another kind cannot build
        raise ConfigError(f"{where} is not valid YAML: {clipped(str(exc))}") from exc
    except RecursionError as exc:
        raise ConfigError(f"{where} is nested too deeply") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must hold {holds}")
    return data
