"""`python -m twinkle.demo`: the main job in one command.

Builds a tiny Qwen-family model locally, launches a real Twinkle server on an embedded broker, and
trains a LoRA adapter against it with the unmodified Tinker SDK: forward_backward + optim_step,
save_state, then sampling from the trained weights. The loss printed each step falls.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from twinkle.tiny_model import ensure_tiny_model

PROMPT = "Twinkle, twinkle, little star, how I wonder what you are."
DEFAULT_WORKDIR = "outputs/demo"  # under the repository's ignored outputs/ when run from its root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(workdir: Path, model_dir: Path, backend: str, port: int) -> Path:
    config = {
        "http_options": {"host": "127.0.0.1", "port": port},
        "storage": {"checkpoint_dir": str(workdir / "checkpoints")},
        "applications": [
            {"name": "server", "route_prefix": "/api/v1", "import_path": "server", "args": {}},
            {"name": "models-tiny", "route_prefix": "/api/v1/model/tiny-qwen", "import_path": "model",
             "args": {"backend": backend, "model_id": str(model_dir), "max_length": 512,
                      "torch_dtype": "float32", "adapter_config": {"max_loras": 4}}},
        ],
    }
    path = workdir / "server_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def launch(config: Path, log: Path, port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "twinkle.server", "launch", "-c", str(config)],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, TWINKLE_LOG_LEVEL="WARNING"))
    started = time.time()
    while "[twinkle] ready" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.time() - started > 300:
            raise SystemExit("the server did not start:\n" + log.read_text(errors="replace"))
        time.sleep(0.2)
    print(f"server ready on http://127.0.0.1:{port} in {time.time() - started:.1f} s (log: {log})")
    return proc


def train(base_url: str, model_dir: Path, steps: int) -> None:
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokens = tokenizer.encode(PROMPT)
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:],
                                        "weights": [1.0] * (len(tokens) - 1)})  # type: ignore[dict-item]
    service = tinker.ServiceClient(base_url=base_url, api_key="tml-demo")
    # a fixed seed: the same LoRA initialisation, so every run shows the same curve
    training = service.create_lora_training_client(base_model="tiny-qwen", rank=16, seed=0).result()
    print(f"training LoRA adapter {training.model_id} on {len(tokens)} tokens")
    for step in range(1, steps + 1):
        fb = training.forward_backward([datum], "cross_entropy")
        opt = training.optim_step(types.AdamParams(learning_rate=5e-3))
        loss = fb.result().metrics["loss:sum"] / (len(tokens) - 1)
        opt.result()
        print(f"step {step:3d}  loss per token {loss:.4f}")
    saved = training.save_state("demo-final").result()
    print(f"saved {saved.path}")
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = tokens[:6]
    result = sampler.sample(types.ModelInput.from_ints(prompt), 1,
                            types.SamplingParams(max_tokens=len(tokens) - 6, temperature=0.0)).result()
    print("prompt :", tokenizer.decode(prompt))
    print("sampled:", tokenizer.decode(prompt + list(result.sequences[0].tokens)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["transformers", "mock"], default="transformers")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workdir", default=DEFAULT_WORKDIR,
                        help=f"where the model, config, checkpoints and server log stay (default: {DEFAULT_WORKDIR})")
    ns = parser.parse_args()
    workdir = Path(ns.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_tiny_model(workdir / "tiny-qwen")  # built once, reused by later runs
    port = free_port()
    log = workdir / "server.log"
    proc = launch(write_config(workdir, model_dir, ns.backend, port), log, port)
    try:
        train(f"http://127.0.0.1:{port}", model_dir, ns.steps)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        print(f"server stopped; its log stays in {log}")


if __name__ == "__main__":
    main()
