"""The pieces of the `megatron` backend (megatron-core, GPU).

Importing this package imports neither torch nor megatron-core; each module says what it needs:

    requirements    whether megatron-core and CUDA are present, as a message naming what is missing
                    (standard library only, so `check-config` can ask cheaply)
    architecture    the HF config of a dense decoder (Qwen2/Qwen3/Llama family) as the numbers Megatron needs
    weight_layout   HF ⇄ Megatron state-dict names and layouts, and tensor-parallel split/merge (torch only)
    lora_layout     PEFT ⇄ Megatron LoRA names and their tensor-parallel split/merge (torch only)
    lora_hooks      per-tenant LoRA deltas added to Megatron's linear layers by forward hooks (torch only)
    parallel        the device mesh mapped to Megatron's parallel state (megatron-core when initializing)
    model           the Megatron GPTModel built from the HF config and loaded with HF weights (megatron-core)
    optimizer       one tenant's Adam step with gradients reduced over the data- and tensor-parallel groups
    cpu_support     the few megatron-core calls that assume CUDA, adjusted for CPU test runs (megatron-core)
"""
