"""Remote encode on the processor pool vs local encode, on the same rows.

    python bench/encode.py [--rows 2000]

Encodes self-cognition rows (chat template + tokenization, loss on assistant turns) with the tiny model's
tokenizer: locally with `twinkle.dataset.Dataset.encode`, then through `twinkle_client.dataset.Dataset`
against a launched server whose processor pool has 1, then 2 worker processes. Prints rows/s and the
ratios; the 2-process pool must beat the 1-process pool.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.harness import launch
from twinkle.tiny_model import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def write_rows(path: Path, n: int) -> Path:
    source = [json.loads(line) for line in (ROOT / "cookbook/data/self_cognition.jsonl").read_text().splitlines()]
    with path.open("w") as out:
        for i in range(n):
            row = dict(source[i % len(source)])
            row["query"] = f"{row['query']} ({i})"
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def local_rows_per_s(data: Path, model_dir: Path) -> float:
    from twinkle.dataset import Dataset, DatasetMeta

    dataset = Dataset(dataset_meta=DatasetMeta(str(data)))
    dataset.set_template("Qwen3_5Template", model_id=str(model_dir), max_length=512)
    dataset.map("SelfCognitionProcessor", init_args={"model_name": "twinkle", "model_author": "team"})
    started = time.perf_counter()
    dataset.encode(batched=True, load_from_cache_file=False)
    return len(dataset) / (time.perf_counter() - started)


def remote_rows_per_s(data: Path, model_dir: Path, work: Path, processes: int, db: int) -> float:
    from twinkle_client import init_twinkle_client
    from twinkle_client.dataset import Dataset, DatasetMeta

    processor = {"name": "processor", "route_prefix": "/api/v1/processor", "import_path": "processor",
                 "args": {"ncpu_proc_per_node": processes}}
    (work / f"p{processes}").mkdir()
    server = launch(work / f"p{processes}", model_dir, db=db, extra_apps=[processor])
    try:
        client = init_twinkle_client(base_url=server.base_url, api_key="tml-bench-encode")
        dataset = Dataset(dataset_meta=DatasetMeta(str(data)))
        dataset.set_template("Qwen3_5Template", model_id="tiny-qwen", max_length=512)
        dataset.map("SelfCognitionProcessor", init_args={"model_name": "twinkle", "model_author": "team"})
        warm = Dataset.from_rows(dataset.to_rows()[: 4 * processes])  # each process loads its tokenizer once
        warm.set_template("Qwen3_5Template", model_id="tiny-qwen", max_length=512)
        warm.encode(batched=True, num_proc=processes, chunk_size=1)
        started = time.perf_counter()
        dataset.encode(batched=True, num_proc=processes)
        rate = len(dataset) / (time.perf_counter() - started)
        client.close()
        return rate
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2000)
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = ensure_tiny_model(work / "tiny-qwen")
        data = write_rows(work / "rows.jsonl", ns.rows)
        local = local_rows_per_s(data, model_dir)
        one = remote_rows_per_s(data, model_dir, work, 1, db=7)
        two = remote_rows_per_s(data, model_dir, work, 2, db=7)
    print(f"local encode                      {local:8.1f} rows/s")
    print(f"remote encode, 1 processor worker {one:8.1f} rows/s  ({one / local:.2f}x local)")
    print(f"remote encode, 2 processor workers{two:8.1f} rows/s  ({two / local:.2f}x local, {two / one:.2f}x one)")


if __name__ == "__main__":
    main()
