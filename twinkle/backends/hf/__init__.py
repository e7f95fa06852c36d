"""The pieces of the HuggingFace (transformers + PEFT) backend and the torch sampler.

`loading` finds and loads the base model once, `lora` turns a `LoraSpec` into a PEFT config, `tenants`
keeps many tenants' adapters on one PeftModel, `batching` turns Datums into padded tensors and target-token
logprobs, `optimizer` runs one tenant's Adam step, `checkpoint` saves and restores an adapter, and
`generation` is the sampling loop both the backend and the sampler use.
"""
