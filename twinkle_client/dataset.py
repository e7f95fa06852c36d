"""Dataset: the local twinkle Dataset, except that encode() runs on the server's processor pool.

Loading, slicing and map() stay on this machine; set_template() only records the template's name and
arguments (the tokenizer is loaded on the server, so this machine needs no model files); encode() sends
the trajectories in chunks to the server and stores the features it returns:

    dataset = Dataset(dataset_meta=DatasetMeta('ms://swift/self-cognition', data_slice=range(500)))
    dataset.set_template('Qwen3_5Template', model_id='ms://Qwen/Qwen3.5-4B', max_length=512)
    dataset.map('SelfCognitionProcessor', init_args={'model_name': 'twinkle', 'model_author': 'ModelScope'})
    dataset.encode(batched=True, num_proc=8, timeout=3600)
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from twinkle.dataset import Dataset as LocalDataset
from twinkle.dataset import DatasetMeta
from twinkle.template import Template
from twinkle_client.client import TwinkleClient, current_client
from twinkle_client.encoding import DEFAULT_TIMEOUT, encode_remotely
from twinkle_client.errors import InvalidArgument


class Dataset(LocalDataset):
    """A twinkle.dataset.Dataset whose encode() runs remotely (on `client`, default the current client)."""

    _client: TwinkleClient | None = None
    template_name: str | None = None
    template_kwargs: Mapping[str, Any] = MappingProxyType({})

    def __init__(self, dataset_meta: DatasetMeta | str, *, client: TwinkleClient | None = None) -> None:
        super().__init__(dataset_meta)
        self._client = client

    def set_template(self, template: str | Template, **init_args: Any) -> Dataset:
        """The template the server encodes with: a registered name and its arguments (model_id, max_length,
        ...), or a Template, whose class name, model_id, max_length and truncation are sent."""
        if isinstance(template, str):
            self.template = None
            self.template_name, self.template_kwargs = template, dict(init_args)
        else:
            super().set_template(template, **init_args)
            self.template_name = type(template).__name__
            self.template_kwargs = {
                "model_id": template.model_id,
                "max_length": template.max_length,
                "truncation": template.truncation,
            }
        return self

    def encode(
        self,
        batched: bool = True,
        num_proc: int = 1,
        load_from_cache_file: bool = True,
        add_generation_prompt: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        chunk_size: int | None = None,
    ) -> Dataset:
        """Encode every trajectory on the server's processor pool, `num_proc` chunks at a time.

        `timeout` bounds the whole encode in seconds (raising FutureTimeout); `batched` and
        `load_from_cache_file` are accepted for compatibility with the local Dataset (remote encode always
        sends batches and keeps no cache).
        """
        if self.template_name is None:
            raise InvalidArgument(
                "encode() needs a template: call set_template('Qwen3_5Template', "
                "model_id=..., max_length=...) first."
            )
        if self.kind == "feature":
            raise InvalidArgument("This dataset is already encoded.")
        rows = self.to_rows()
        if self.kind == "raw" and rows and "messages" not in rows[0]:
            raise InvalidArgument(
                f"The rows are not trajectories yet (columns: {sorted(rows[0])}). Map a "
                "preprocessor that makes trajectories first, e.g. map('SelfCognitionProcessor', ...)."
            )
        features = encode_remotely(
            self._client or current_client(),
            rows,
            self.template_name,
            self.template_kwargs,
            add_generation_prompt=add_generation_prompt,
            num_proc=num_proc,
            timeout=timeout,
            chunk_size=chunk_size,
        )
        encoded = LocalDataset.from_rows(features, kind="feature")
        # Take over the encoded table; the local class keeps rows and their kind in these two fields.
        self._table, self._kind = encoded._table, encoded.kind
        return self


__all__ = ["Dataset", "DatasetMeta"]
