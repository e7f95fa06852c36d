"""The strict base every config section derives from, and the error validators raise.

Every section forbids unknown keys, so a misspelt field fails at load time instead of silently taking
its default. Field docstrings double as the field descriptions that `docs/config.md` is generated from.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticCustomError

#: The error type the loader recognises as "a problem located at `subpath` below this model".
PROBLEM_ERROR_TYPE = "twinkle_config_problem"


class StrictModel(BaseModel):
    """A config section: unknown keys are errors, field docstrings are the documentation."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)


def config_problem(message: str, *, subpath: str = "", hint: str = "") -> PydanticCustomError:
    """An error for a cross-field check, pointing at `subpath` below the model that raised it.

    Validators of a whole model can only fail at the model's own location; `subpath` lets the loader
    report the field the user has to change (for example `file_path` under `persistence`).
    """
    return PydanticCustomError(
        PROBLEM_ERROR_TYPE, "{message}", {"message": message, "subpath": subpath, "hint": hint}
    )
