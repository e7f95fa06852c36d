"""docs/config.md documents every config field and matches the models it is generated from."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel
from typing_extensions import is_typeddict

import twinkle.config as config_package
from twinkle.config import Application
from twinkle.config.reference import generated_part, render_reference

DOC = Path(__file__).resolve().parents[3] / "docs" / "config.md"

DOCUMENTED = [
    getattr(config_package, name)
    for name in config_package.__all__
    if isinstance(getattr(config_package, name), type)
    and (issubclass(getattr(config_package, name), BaseModel) or is_typeddict(getattr(config_package, name)))
]


def _section(document: str, title: str) -> str:
    match = re.search(rf"^### {title}\n(.*?)(?=^### |\Z)", document, flags=re.MULTILINE | re.DOTALL)
    assert match is not None, f"docs/config.md has no section for {title}"
    return match.group(1)


def _field_names(model: type) -> list[str]:
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields)
    return list(model.__annotations__)


@pytest.mark.parametrize("model", DOCUMENTED, ids=lambda model: model.__name__)
def test_every_field_of_every_config_model_has_a_row_in_docs_config_md(model: type) -> None:
    document = DOC.read_text(encoding="utf-8")
    # The base Application is documented through its four kinds, which share its fields.
    titles = (
        ["ServerApp", "ModelApp", "SamplerApp", "ProcessorApp"] if model is Application else [model.__name__]
    )

    for title in titles:
        section = _section(document, title)
        missing = [name for name in _field_names(model) if f"| `{name}` |" not in section]
        assert missing == [], f"{title} fields missing from docs/config.md"


def test_the_generated_reference_in_docs_config_md_is_up_to_date() -> None:
    document = DOC.read_text(encoding="utf-8")

    assert generated_part(document) == render_reference(), (
        "docs/config.md is stale: run python -m twinkle.config.reference --write docs/config.md"
    )
