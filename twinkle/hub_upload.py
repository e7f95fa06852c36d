"""Publishing a checkpoint directory to a model hub (ModelScope by default, Hugging Face with hf://)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from twinkle.errors import BackendFailure, InvalidRequest


def upload_checkpoint(directory: Path, hub_model_id: str, *, token: str | None, private: bool) -> dict[str, Any]:
    """Upload every file of `directory` to `hub_model_id` (`hf://org/name` or `[ms://]org/name`)."""
    hub, _, repo = hub_model_id.partition("://") if "://" in hub_model_id else ("ms", "", hub_model_id)
    if repo.count("/") != 1:
        raise InvalidRequest(f"Hub model id {hub_model_id!r} must look like 'org/name'.")
    try:
        if hub == "hf":
            from huggingface_hub import HfApi

            api = HfApi(token=token)
            api.create_repo(repo, private=private, exist_ok=True)
            api.upload_folder(repo_id=repo, folder_path=str(directory))
            url = f"https://huggingface.co/{repo}"
        elif hub == "ms":
            try:
                from modelscope.hub.api import HubApi
            except ImportError:
                raise InvalidRequest("Uploading to ModelScope needs the modelscope package on the server.",
                                     hint="pip install modelscope, or upload to hf://<org>/<name>.") from None
            ms = HubApi()
            if token:
                ms.login(token)
            ms.upload_folder(repo_id=repo, folder_path=str(directory))
            url = f"https://modelscope.cn/models/{repo}"
        else:
            raise InvalidRequest(f"Unknown hub {hub!r} in {hub_model_id!r}.", hint="Use hf://org/name or ms://org/name.")
    except InvalidRequest:
        raise
    except Exception as exc:
        raise BackendFailure(f"Uploading to {hub_model_id} failed: {type(exc).__name__}: {exc}",
                             hint="Check the hub token and that the server can reach the hub.") from exc
    return {"hub_model_id": hub_model_id, "url": url}
