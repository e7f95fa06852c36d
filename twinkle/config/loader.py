"""Reading, validating and printing server configs.

`load_config` reads YAML, `parse_config` takes an already-parsed mapping; both interpolate `${VAR}`
references (see `twinkle.config.interpolation`) and raise one `ConfigError` listing every problem.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from twinkle.config.interpolation import interpolate
from twinkle.config.problems import ConfigError, Problem, problems_from_validation_error
from twinkle.config.server_config import ServerConfig

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _StrictYamlLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys, which plain YAML resolves silently (the last one wins)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue  # `<<: *anchor` keys may be overridden by explicit ones; that is their purpose
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, Hashable) and key in seen:
                first = seen[key]
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first defined on line {first.line + 1})",
                    key_node.start_mark,
                )
            if isinstance(key, Hashable):
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> ServerConfig:
    """The validated config in the YAML file at `path`; ConfigError lists every problem found."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            [Problem("", f"no such file: {source}", "pass -c PATH or set TWINKLE_SERVER_CONFIG")], source
        ) from None
    except OSError as error:
        raise ConfigError([Problem("", f"cannot read {source}: {error.strerror}")], source) from None
    try:
        data = yaml.load(text, Loader=_StrictYamlLoader)
    except yaml.YAMLError as error:
        raise ConfigError([_yaml_problem(error)], source) from None
    return parse_config(data, source=source, env=env)


def parse_config(data: Any, source: str = "<config>", env: Mapping[str, str] | None = None) -> ServerConfig:
    """The validated config for an already-parsed mapping; ConfigError lists every problem found.

    `env` (default: the process environment) fills `${VAR}` references in string values.
    """
    if data is None:
        raise ConfigError([Problem("", "the config is empty", "at least list the applications")], source)
    if not isinstance(data, Mapping):
        raise ConfigError([Problem("", f"the config must be a mapping, not {type(data).__name__}")], source)
    resolved, problems, broken = interpolate(dict(data), os.environ if env is None else env)
    try:
        config = ServerConfig.model_validate(resolved)
    except ValidationError as error:
        for problem, loc in problems_from_validation_error(error, ServerConfig):
            # A value whose interpolation failed is still the raw `${...}` text; its type error is noise.
            if loc not in broken:
                problems.append(problem)
    if problems:
        raise ConfigError(problems, source)
    return config


def config_to_dict(config: ServerConfig) -> dict[str, Any]:
    """The config as plain JSON-compatible data, every default filled in; parse_config accepts it back."""
    return config.model_dump(mode="json")


def _yaml_problem(error: yaml.YAMLError) -> Problem:
    mark = getattr(error, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    what = getattr(error, "problem", None) or str(error)
    context = getattr(error, "context", None)
    message = f"YAML syntax error: {what}" + (f" ({context})" if context else "")
    if "duplicate key" in what:
        return Problem(where, message, "keep only one of them")
    return Problem(where, message, "check the indentation and the ':' after each key near that line")
