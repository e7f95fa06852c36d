"""Sampling on a hosted Twinkle server with the Tinker SDK: self_host/sample.py with hosted defaults.

TWINKLE_SERVER_URL=... MODELSCOPE_TOKEN=... python cookbook/client/tinker/modelscope/sample.py
"""

from dataclasses import replace

from hosted import self_host_example, server_token, server_url

from twinkle.example_connection import server_messages

if __name__ == "__main__":
    with server_messages():
        example = self_host_example("sample")
        example.main(defaults=replace(example.Config(), base_url=server_url(), api_key=server_token()))
