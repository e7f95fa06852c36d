"""Chat templates: trajectories to token ids and loss labels, with a model's own tokenizer."""

from twinkle.template.base import Template, Truncation
from twinkle.template.qwen import Qwen3_5Template
from twinkle.template.registry import get_template, register_template, template_names

__all__ = ["Qwen3_5Template", "Template", "Truncation", "get_template", "register_template", "template_names"]
