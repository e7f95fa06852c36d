"""Sampling on a hosted Twinkle server with the Tinker SDK: self_host/sample.py with hosted defaults.

TWINKLE_SERVER_URL=... MODELSCOPE_TOKEN=... python cookbook/client/tinker/modelscope/sample.py
"""

from hosted import run_hosted

if __name__ == "__main__":
    run_hosted("sample")
