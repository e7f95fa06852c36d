"""Hub references (`ms://org/name`, `hf://org/name`) and fetching them, one code path for both hubs.

Local paths never touch a hub. Hub clients are imported only when a hub reference is used, so working
offline needs neither package, and an unreachable hub turns into one error that says what to do instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from twinkle.errors import InvalidRequest

Hub = Literal["ms", "hf"]
HUB_NAMES: dict[Hub, str] = {"ms": "ModelScope", "hf": "Hugging Face"}
HUB_PACKAGES: dict[Hub, str] = {"ms": "modelscope", "hf": "huggingface_hub"}

T = TypeVar("T")


@dataclass(frozen=True)
class HubId:
    hub: Hub
    repo_id: str

    def __str__(self) -> str:
        return f"{self.hub}://{self.repo_id}"


def parse_hub_id(reference: str) -> HubId | None:
    """The hub and repository named by `ms://...` or `hf://...`; None for anything else (a local path)."""
    for hub in HUB_NAMES:
        prefix = f"{hub}://"
        if reference.startswith(prefix):
            repo_id = reference[len(prefix) :].strip("/")
            if not repo_id:
                raise InvalidRequest(f"{reference!r} names no repository.", hint=f"Use {prefix}org/name.")
            return HubId(hub, repo_id)
    return None


def fetch_from_hub(hub_id: HubId, what: str, fetch: Callable[[], T]) -> T:
    """Run `fetch` (a download through the hub's client), turning every failure into one clear error."""
    try:
        return fetch()
    except ImportError as missing:
        raise InvalidRequest(
            f"Loading {what} {hub_id} needs the {HUB_PACKAGES[hub_id.hub]} package ({missing}).",
            hint=f"pip install {HUB_PACKAGES[hub_id.hub]}, or download it and pass the local path instead.",
        ) from missing
    except InvalidRequest:
        raise
    except Exception as error:  # hub clients raise anything from OSError to their own error types
        raise InvalidRequest(
            f"Could not load {what} {hub_id} from {HUB_NAMES[hub_id.hub]}: {type(error).__name__}: {error}",
            hint="Check the id and that the hub is reachable from here, or download it and pass the local path.",
        ) from error


def model_directory(model_id: str | Path) -> Path:
    """A local directory holding the model files: the path itself, or a snapshot of a hub repository."""
    reference = str(model_id)
    hub_id = parse_hub_id(reference)
    if hub_id is None:
        local = Path(reference).expanduser()
        if not local.is_dir():
            raise InvalidRequest(
                f"Model {reference!r} is not a local directory.",
                hint="Pass a model directory, or a hub id such as ms://Qwen/Qwen3.5-4B or hf://Qwen/Qwen3-0.6B.",
            )
        return local
    return Path(fetch_from_hub(hub_id, "model", lambda: _snapshot(hub_id)))


def _snapshot(hub_id: HubId) -> str:
    if hub_id.hub == "ms":
        from modelscope import snapshot_download as ms_snapshot_download  # type: ignore[import-not-found]

        return str(ms_snapshot_download(hub_id.repo_id))
    from huggingface_hub import snapshot_download as hf_snapshot_download

    return str(hf_snapshot_download(hub_id.repo_id))
