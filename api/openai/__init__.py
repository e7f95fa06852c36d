"""The OpenAI-compatible endpoints at /v1: chat and text completions and the model list."""
