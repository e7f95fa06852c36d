"""The field reference in docs/config.md, generated from the config models so it cannot drift.

python -m twinkle.config.reference                        # print the generated reference
python -m twinkle.config.reference --write docs/config.md # refresh it between the markers
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Union

import annotated_types
from pydantic import BaseModel, TypeAdapter
from pydantic.fields import FieldInfo
from typing_extensions import is_typeddict

from twinkle.config.server_config import ServerConfig

BEGIN_MARKER = (
    "<!-- BEGIN GENERATED REFERENCE (python -m twinkle.config.reference --write docs/config.md) -->"
)
END_MARKER = "<!-- END GENERATED REFERENCE -->"


def render_reference() -> str:
    """Markdown tables of every config section, in the order a config file nests them."""
    sections = []
    for model, paths in _sections():
        lines = [f"### {model.__name__}", ""]
        lines.append(
            "Appears at: " + ", ".join(f"`{path}`" if path else "the top level" for path in paths) + "."
        )
        lines.append("")
        if model.__doc__:
            lines += [_one_line(model.__doc__), ""]
        lines += ["| Field | Type | Default | Meaning |", "| --- | --- | --- | --- |"]
        lines += [
            f"| `{name}` | {_cell(kind)} | {_cell(default)} | {_cell(meaning)} |"
            for name, kind, default, meaning in _rows(model)
        ]
        sections.append("\n".join(lines))
    return "\n\n".join(sections) + "\n"


def splice_reference(document: str, reference: str) -> str:
    """`document` with the text between the markers replaced by `reference`."""
    start = document.index(BEGIN_MARKER) + len(BEGIN_MARKER)
    end = document.index(END_MARKER)
    return f"{document[:start]}\n\n{reference}\n{document[end:]}"


def generated_part(document: str) -> str:
    """The text between the markers, as `render_reference` produced it."""
    start = document.index(BEGIN_MARKER) + len(BEGIN_MARKER)
    return document[start : document.index(END_MARKER)].strip("\n") + "\n"


def _sections() -> list[tuple[type, list[str]]]:
    """Every model and TypedDict reachable from ServerConfig, with the YAML paths it appears at."""
    found: dict[type, list[str]] = {}
    order: list[type] = []

    def visit(model: type, path: str) -> None:
        if model in found:
            if path not in found[model]:
                found[model].append(path)
            return
        found[model] = [path]
        order.append(model)
        for name, annotation in _field_annotations(model):
            for nested, suffix in _nested_models(annotation):
                visit(nested, f"{path}.{name}{suffix}" if path else f"{name}{suffix}")

    visit(ServerConfig, "")
    return [(model, found[model]) for model in order]


def _field_annotations(model: type) -> Iterator[tuple[str, Any]]:
    if issubclass(model, BaseModel):
        yield from ((name, field.annotation) for name, field in model.model_fields.items())
    else:
        yield from typing.get_type_hints(model, include_extras=True).items()


def _nested_models(annotation: Any, suffix: str = "") -> Iterator[tuple[type, str]]:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        yield from _nested_models(args[0], suffix)
    elif origin in (Union, types.UnionType):
        for member in args:
            yield from _nested_models(member, suffix)
    elif origin is list:
        yield from _nested_models(args[0], suffix + "[]")
    elif origin is dict:
        yield from _nested_models(args[1], suffix + ".<key>")
    elif _is_section(annotation):
        yield annotation, suffix


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and (issubclass(annotation, BaseModel) or is_typeddict(annotation))


def _rows(model: type) -> list[tuple[str, str, str, str]]:
    if issubclass(model, BaseModel):
        return [
            (
                name,
                _type_text(field.annotation, field.metadata),
                _default_text(field),
                _one_line(field.description),
            )
            for name, field in model.model_fields.items()
        ]
    schema = TypeAdapter(model).json_schema()["properties"]
    return [
        (name, _type_text(annotation), "unset", _one_line(schema[name].get("description")))
        for name, annotation in typing.get_type_hints(model, include_extras=True).items()
    ]


def _type_text(annotation: Any, metadata: list[Any] | None = None) -> str:
    text = _bare_type_text(annotation)
    bounds = [_bound_text(item) for item in [*(metadata or []), *_annotated_metadata(annotation)]]
    bounds = [bound for bound in bounds if bound]
    return f"{text} ({', '.join(bounds)})" if bounds else text


def _annotated_metadata(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) is typing.Annotated:
        return list(typing.get_args(annotation)[1:])
    return []


def _bare_type_text(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is typing.Annotated:
        return _bare_type_text(args[0])
    if origin is Literal:
        return " \\| ".join(json.dumps(value) for value in args)
    if origin in (Union, types.UnionType):
        return " \\| ".join(_bare_type_text(member) for member in args)
    if origin is list:
        return f"list[{_bare_type_text(args[0])}]"
    if origin is dict:
        return f"dict[{_bare_type_text(args[0])}, {_bare_type_text(args[1])}]"
    if _is_section(annotation):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    return getattr(annotation, "__name__", str(annotation))


def _bound_text(item: Any) -> str:
    if isinstance(item, annotated_types.Ge):
        return f">= {item.ge}"
    if isinstance(item, annotated_types.Gt):
        return f"> {item.gt}"
    if isinstance(item, annotated_types.Le):
        return f"<= {item.le}"
    if isinstance(item, annotated_types.Lt):
        return f"< {item.lt}"
    if isinstance(item, annotated_types.MinLen):
        return "non-empty" if item.min_length == 1 else f"length >= {item.min_length}"
    if isinstance(item, FieldInfo):
        return ", ".join(filter(None, (_bound_text(inner) for inner in item.metadata)))
    return ""


def _default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "**required**"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        # A section whose default differs from the section's own defaults (processors default to CPU).
        own = type(value)().model_dump(mode="json")
        changed = {key: item for key, item in value.model_dump(mode="json").items() if own.get(key) != item}
        if not changed:
            return "defaults"
        return "defaults, except " + ", ".join(
            f"`{key}: {_yaml_scalar(item)}`" for key, item in changed.items()
        )
    if isinstance(value, dict) and not value:
        return "`{}`"
    return f"`{_yaml_scalar(value)}`"


def _yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return json.dumps(value, default=_changed_fields)


def _changed_fields(value: Any) -> Any:
    """A section inside a default (tenancy's default tier): only what differs from the section's defaults."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_defaults=True)
    raise TypeError(f"{type(value).__name__} has no JSON form")


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def _cell(text: str) -> str:
    # A bare `|` would end the table cell; the ones already escaped by _bare_type_text stay as they are.
    return text.replace("\\|", "\0").replace("|", "\\|").replace("\0", "\\|")


def main(argv: list[str] | None = None) -> int:
    """Print the reference, or splice it into a markdown file between the markers."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--write", metavar="MARKDOWN", type=Path, help="file to update in place")
    options = parser.parse_args(argv)
    reference = render_reference()
    if options.write is None:
        print(reference, end="")
        return 0
    document = options.write.read_text(encoding="utf-8")
    options.write.write_text(splice_reference(document, reference), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
