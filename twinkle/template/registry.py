"""Templates by name, so configs and remote calls can say `'Qwen3_5Template'` instead of importing a class."""

from __future__ import annotations

from typing import Any, TypeVar

from twinkle.errors import InvalidRequest
from twinkle.template.base import Template
from twinkle.template.qwen import Qwen3_5Template

TemplateClass = TypeVar("TemplateClass", bound=type[Template])

_TEMPLATES: dict[str, type[Template]] = {}


def register_template(cls: TemplateClass) -> TemplateClass:
    """Make a Template subclass available by its class name (usable as a decorator)."""
    _TEMPLATES[cls.__name__] = cls
    return cls


def template_names() -> list[str]:
    return sorted(_TEMPLATES)


def get_template(name: str, **init_args: Any) -> Template:
    """A new template of the class registered as `name`, built with `init_args` (model_id, max_length, ...)."""
    if name not in _TEMPLATES:
        raise InvalidRequest(
            f"Unknown template {name!r}.", hint=f"Valid names: {', '.join(template_names())}."
        )
    return _TEMPLATES[name](**init_args)


register_template(Template)
register_template(Qwen3_5Template)
