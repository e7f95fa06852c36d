"""`${VAR}` and `${VAR:-default}` in config string values, filled in from the environment.

- `${VAR}` is replaced by the value of VAR; an unset VAR is a config problem.
- `${VAR:-default}` is replaced by VAR when it is set and non-empty, else by `default` (which may be
  empty and cannot contain `}`).
- `$${` writes a literal `${`.

Only string values are interpolated, never keys, and the result stays a string: pydantic then converts
`"8000"` to an int where the field is an int, exactly as if the YAML had said 8000.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from twinkle.config.problems import Loc, Problem, format_loc

_REFERENCE = re.compile(
    r"\$\$(?=\{)"  # escaped: `$${` stands for a literal `${`
    r"|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>[^}]*))?\}"
    r"|(?P<malformed>\$\{)"
)


def interpolate(data: Any, env: Mapping[str, str]) -> tuple[Any, list[Problem], set[Loc]]:
    """`data` with every reference replaced, the problems found, and the locations that had problems.

    A value with a problem is left as written, so the caller can skip the errors it would cause later.
    """
    problems: list[Problem] = []
    broken: set[Loc] = set()
    result = _interpolate(data, env, (), problems, broken)
    return result, problems, broken


def _interpolate(
    value: Any, env: Mapping[str, str], loc: Loc, problems: list[Problem], broken: set[Loc]
) -> Any:
    if isinstance(value, dict):
        return {
            key: _interpolate(item, env, (*loc, str(key)), problems, broken) for key, item in value.items()
        }
    if isinstance(value, list):
        return [_interpolate(item, env, (*loc, index), problems, broken) for index, item in enumerate(value)]
    if isinstance(value, str) and "${" in value:
        return _interpolate_string(value, env, loc, problems, broken)
    return value


def _interpolate_string(
    text: str, env: Mapping[str, str], loc: Loc, problems: list[Problem], broken: set[Loc]
) -> str:
    found: list[Problem] = []

    def replace(match: re.Match[str]) -> str:
        if match.group("malformed"):
            found.append(
                Problem(
                    format_loc(loc),
                    f"malformed reference in {text!r}",
                    "write ${NAME} or ${NAME:-default} (NAME: letters, digits, _), or $${ for a literal ${",
                )
            )
            return match.group(0)
        name = match.group("name")
        if name is None:
            return "$"
        default = match.group("default")
        value = env.get(name)
        if default is not None and not value:
            return default
        if value is None:
            found.append(
                Problem(
                    format_loc(loc),
                    f"environment variable {name} is not set",
                    f"export {name}, or give a default with ${{{name}:-default}}",
                )
            )
            return match.group(0)
        return value

    result = _REFERENCE.sub(replace, text)
    if found:
        problems.extend(found)
        broken.add(loc)
        return text
    return result
