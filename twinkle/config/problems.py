"""Config problems: one per mistake, each located by its YAML path, all reported together.

Pydantic locates errors by tuples such as `('applications', 1, 'model', 'args', 'device_group', 'rank')`,
where `'model'` is the tag the application union was dispatched on. This module turns them into the
paths users see in their YAML (`applications[1].args.device_group.rank`), suggests the field they probably
meant, and explains removed fields.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from dataclasses import asdict, dataclass
from typing import Any, Literal, Union

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from twinkle.config.base import PROBLEM_ERROR_TYPE
from twinkle.errors import UserError

Loc = tuple[int | str, ...]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config."""

    path: str
    """Where, as a YAML path (`applications[1].args.model_id`), or `line L, column C` for syntax."""
    message: str
    """What is wrong."""
    hint: str | None = None
    """What to do about it, when there is something better to say than the message."""

    def __str__(self) -> str:
        text = f"{self.path}: {self.message}" if self.path else self.message
        return f"{text} ({self.hint})" if self.hint else text


class ConfigError(UserError):
    """Raised when a server config cannot be used; `problems` lists every mistake found."""

    code = "invalid_config"

    def __init__(self, problems: list[Problem], source: str = "<config>") -> None:
        count = len(problems)
        summary = f"{source}: {count} config problem{'s' if count != 1 else ''}"
        super().__init__(summary, problems=[asdict(problem) for problem in problems])
        self.problems = list(problems)
        self.source = source

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.problems, self.source))

    def __str__(self) -> str:
        return "\n".join([self.message, *(f"  {problem}" for problem in self.problems)])


# Keys older configs used; each entry turns the given value into the message that says what to write.
_LEGACY_FIELDS: dict[str, typing.Callable[[Any], str]] = {
    "use_megatron": lambda value: (
        "'use_megatron' was replaced by 'backend': write "
        + ("'backend: megatron'" if value else "'backend: transformers'")
        + " instead"
    ),
    "max_loras": lambda value: (
        f"'max_loras' moved into adapter_config: write 'adapter_config: {{max_loras: {value}}}'"
    ),
    "task_queue": lambda value: "'task_queue' was removed: set queue_config in each application's args",
}


def problems_from_validation_error(
    error: ValidationError, root: type[BaseModel]
) -> list[tuple[Problem, Loc]]:
    """One Problem per pydantic error, with YAML paths relative to `root`, each with the location of
    the value it is about (union tags removed)."""
    located = []
    for details in error.errors():
        loc, parent, here = _walk(root, tuple(details["loc"]))
        located.append((_problem_from(details, loc, parent, here), loc))
    return located


def format_loc(loc: Loc) -> str:
    """`('applications', 1, 'args')` as `applications[1].args`."""
    text = ""
    for item in loc:
        text += f"[{item}]" if isinstance(item, int) else (f".{item}" if text else str(item))
    return text


def _problem_from(details: ErrorDetails, loc: Loc, parent: type[BaseModel] | None, here: Any) -> Problem:
    kind = details["type"]
    ctx = details.get("ctx") or {}
    path = format_loc(loc)
    if kind == PROBLEM_ERROR_TYPE:
        return Problem(_join(path, ctx.get("subpath", "")), ctx["message"], ctx.get("hint") or None)
    if kind == "extra_forbidden":
        return _unknown_field(path, str(loc[-1]), details["input"], parent)
    if kind == "missing":
        return Problem(path, "field required")
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        return _bad_tag(path, ctx, _union_members(_unwrap(here)))
    message = _lower_first(details["msg"])
    hint = None
    if kind in ("literal_error", "enum"):
        choices = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        hint = _did_you_mean(details["input"], choices)
    return Problem(path, f"{message} (got {_show(details['input'])})", hint)


def _unknown_field(path: str, name: str, value: Any, parent: type[BaseModel] | None) -> Problem:
    legacy = _LEGACY_FIELDS.get(name)
    if legacy is not None:
        return Problem(path, legacy(value))
    fields = sorted(parent.model_fields) if parent is not None else []
    hint = _did_you_mean(name, fields)
    if hint is None and fields:
        hint = f"valid fields here: {', '.join(fields)}"
    return Problem(path, f"unknown field {name!r}", hint)


def _bad_tag(path: str, ctx: dict[str, Any], union: list[Any]) -> Problem:
    field = str(ctx.get("discriminator", "")).strip("'")
    choices = sorted({str(value) for member in union for value in _literal_values(member)})
    listed = f"one of {', '.join(choices)}"
    if "tag" not in ctx:
        return Problem(_join(path, field), "field required", listed)
    return Problem(
        _join(path, field), f"unknown {field} {ctx['tag']!r}", _did_you_mean(ctx["tag"], choices) or listed
    )


def _did_you_mean(value: Any, choices: list[str]) -> str | None:
    if not isinstance(value, str):
        return None
    close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    if not close:
        close = [choice for choice in choices if choice.lower() == value.lower()]
    return f"did you mean {close[0]!r}?" if close else None


def _walk(root: type[BaseModel], loc: Loc) -> tuple[Loc, type[BaseModel] | None, Any]:
    """The user-facing location (union tags removed), the model that owns its last element, and the
    type expected at the location (None where unknown)."""
    shown: list[int | str] = []
    current: Any = root
    owner: type[BaseModel] | None = None
    for item in loc:
        current = _unwrap(current)
        members = _union_members(current)
        if members:
            tagged = [member for member in members if item in _literal_values(member)]
            if tagged:
                current = tagged[0]  # pydantic put the union tag into the location; users never wrote it
                continue
            current = members[0] if len(members) == 1 else None
        shown.append(item)
        owner, current = _step(current, item)
    return tuple(shown), owner, current


def _step(current: Any, item: int | str) -> tuple[type[BaseModel] | None, Any]:
    """The model owning `item` (if `current` is one) and the type found under `item`."""
    if isinstance(current, type) and issubclass(current, BaseModel):
        field = current.model_fields.get(item) if isinstance(item, str) else None
        return current, (field.annotation if field is not None else None)
    origin, args = typing.get_origin(current), typing.get_args(current)
    if origin is list and args:
        return None, args[0]
    if origin is dict and len(args) == 2:
        return None, args[1]
    return None, None


def _unwrap(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _union_members(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) not in (Union, types.UnionType):
        return []
    return [_unwrap(member) for member in typing.get_args(annotation) if member is not type(None)]


def _literal_values(model: Any) -> set[Any]:
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return set()
    values: set[Any] = set()
    for field in model.model_fields.values():
        if typing.get_origin(field.annotation) is Literal:
            values.update(typing.get_args(field.annotation))
    return values


def _join(path: str, subpath: str) -> str:
    if not subpath:
        return path
    if not path or subpath.startswith("["):
        return path + subpath
    return f"{path}.{subpath}"


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
