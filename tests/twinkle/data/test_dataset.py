from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest

from twinkle.data_format import IGNORE_INDEX, Message, Trajectory
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.errors import InvalidRequest
from twinkle.preprocessor import DPOProcessor, SelfCognitionProcessor, math_accuracy_reward
from twinkle.server.common import input_feature_to_datum

from .conftest import DATA_DIR

REPO_ROOT = DATA_DIR.parents[1]
SELF_COGNITION = str(DATA_DIR / "self_cognition.jsonl")


def self_cognition(model_dir: Path, rows: int = 50) -> Dataset:
    dataset = Dataset(DatasetMeta(SELF_COGNITION, data_slice=range(rows)))
    dataset.set_template("Qwen3_5Template", model_id=str(model_dir), max_length=512)
    return dataset.map(
        "SelfCognitionProcessor", init_args={"model_name": "twinkle模型", "model_author": "社区"}
    )


def test_the_twinkle_client_example_runs_on_the_shipped_data(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO_ROOT)
    dataset = Dataset(dataset_meta=DatasetMeta("cookbook/data/self_cognition.jsonl", data_slice=range(50)))
    dataset.set_template("Qwen3_5Template", model_id=str(tiny_model_dir), max_length=512)
    dataset.map(
        "SelfCognitionProcessor", init_args={"model_name": "twinkle模型", "model_author": "ModelScope社区"}
    )
    dataset.encode(batched=True)
    dataloader = DataLoader(dataset=dataset, batch_size=4)

    assert len(dataloader) == 13
    batches = list(dataloader)
    assert len(batches) == 13 and [len(batch) for batch in batches[-2:]] == [4, 2]
    assert dataloader.get_state()["consumed_train_samples"] == 50
    first = batches[0][0]
    assert dataset.template is not None
    assert dataset.template.decode(first["labels"], skip_special_tokens=False) == (
        "我是twinkle模型，由ModelScope社区开发的人工智能助手。有什么可以帮你的吗？<|im_end|>"
    )
    for batch in batches:
        for feature in batch:
            assert feature["input_ids"].dtype == np.int64 and (feature["labels"] != IGNORE_INDEX).any()
            assert "{{" not in dataset.template.decode(feature["input_ids"])

    dataloader.resume_from_checkpoint(48)
    assert [len(batch) for batch in dataloader] == [2]


def test_the_tinker_example_turns_batches_into_datums(tiny_model_dir: Path) -> None:
    dataset = Dataset(dataset_meta=DatasetMeta(SELF_COGNITION, data_slice=range(500)))
    dataset.set_template("Qwen3_5Template", model_id=str(tiny_model_dir), max_length=256)
    dataset.map(SelfCognitionProcessor("twinkle模型", "twinkle团队"), load_from_cache_file=False)
    dataset.encode(batched=True, load_from_cache_file=False)
    dataloader = DataLoader(dataset=dataset, batch_size=8)

    assert len(dataset) == 60 and len(dataloader) == 8
    for batch in dataloader:
        input_datum = [input_feature_to_datum(input_feature) for input_feature in batch]
        weights = np.concatenate([example.loss_fn_inputs["weights"].tolist() for example in input_datum])
        trained = sum(int((feature["labels"][1:] != IGNORE_INDEX).sum()) for feature in batch)
        assert weights.sum() == trained > 0


def test_data_slice_keeps_the_named_rows_and_skips_indices_past_the_end() -> None:
    everything = Dataset(DatasetMeta(SELF_COGNITION))
    assert len(Dataset(DatasetMeta(SELF_COGNITION, data_slice=range(500)))) == len(everything) == 60
    picked = Dataset(DatasetMeta(SELF_COGNITION, data_slice=[3, 1, -1, 99]))
    assert [row["query"] for row in picked] == [everything[i]["query"] for i in (3, 1, 59)]  # type: ignore[index]
    assert len(Dataset(DatasetMeta(SELF_COGNITION, data_slice=slice(10, 20, 2)))) == 5
    with pytest.raises(InvalidRequest, match="data_slice"):
        DatasetMeta(SELF_COGNITION, data_slice="0:10")  # type: ignore[arg-type]


def test_encoding_in_two_processes_or_row_by_row_gives_the_same_features(tiny_model_dir: Path) -> None:
    one = self_cognition(tiny_model_dir).encode(num_proc=1, load_from_cache_file=False)
    two = self_cognition(tiny_model_dir).encode(num_proc=2, load_from_cache_file=False)
    rowwise = self_cognition(tiny_model_dir).encode(batched=False, load_from_cache_file=False)
    assert one.to_rows() == two.to_rows() == rowwise.to_rows()
    assert len(one) == 50


def test_map_accepts_plain_functions_that_rename_drop_or_batch_rows() -> None:
    dataset = Dataset(DatasetMeta(SELF_COGNITION))
    dataset.map(lambda row: {"question": row["query"], "lang": row["tag"]} if row["tag"] == "en" else None)
    assert dataset.kind == "raw" and len(dataset) == 30 and set(dataset[0]) == {"question", "lang"}  # type: ignore[arg-type]

    def to_chats(rows: list[dict[str, Any]]) -> list[Trajectory]:
        return [Trajectory(messages=[Message("user", row["question"])]) for row in rows]

    dataset.map(to_chats, batched=True)
    assert dataset.kind == "trajectory" and dataset[0] == Trajectory(
        messages=[Message("user", "Who are you?")]
    )


def test_map_builds_a_preprocessor_class_with_init_args_and_refuses_init_args_for_callables() -> None:
    dataset = Dataset(DatasetMeta(SELF_COGNITION, data_slice=range(2)))
    dataset.map(SelfCognitionProcessor, init_args={"model_name": "N", "model_author": "A"})
    assert "N" in dataset[0].messages[2].content  # type: ignore[union-attr]
    with pytest.raises(InvalidRequest, match="init_args"):
        dataset.map(SelfCognitionProcessor("N", "A"), init_args={"model_name": "M"})


def test_map_refuses_a_function_that_mixes_trajectories_and_dicts() -> None:
    dataset = Dataset(DatasetMeta(SELF_COGNITION, data_slice=range(4)))
    odd_one_out = SelfCognitionProcessor("N", "A")
    with pytest.raises(InvalidRequest, match="both"):
        dataset.map(
            lambda row: odd_one_out(row) if row["tag"] == "zh" else dict(row), load_from_cache_file=False
        )


def test_an_unknown_preprocessor_name_lists_the_valid_ones() -> None:
    with pytest.raises(InvalidRequest) as raised:
        Dataset(DatasetMeta(SELF_COGNITION)).map("SelfCognition")
    assert "SelfCognitionProcessor" in str(raised.value) and "GSM8KProcessor" in str(raised.value)


def test_dpo_rows_become_positive_negative_pairs_that_batch_together(tiny_model_dir: Path) -> None:
    dataset = Dataset(DatasetMeta(str(DATA_DIR / "dpo_pairs.jsonl")))
    dataset.map(DPOProcessor()).set_template("Qwen3_5Template", model_id=str(tiny_model_dir)).encode()
    assert len(dataset) == 80
    batch = next(iter(DataLoader(dataset, batch_size=4)))
    assert [feature["extra"]["preference"] for feature in batch] == ["positive", "negative"] * 2
    template = dataset.template
    assert template is not None
    chosen, rejected = (template.decode(feature["labels"]) for feature in batch[:2])
    assert chosen.startswith("法国的首都是巴黎") and rejected == "The capital of France is Paris."
    prompts = [template.decode(f["input_ids"][f["labels"] == IGNORE_INDEX]) for f in batch[:2]]
    assert prompts[0] == prompts[1]


def test_gsm8k_prompts_encode_open_with_the_ground_truth_alongside(tiny_model_dir: Path) -> None:
    dataset = Dataset(DatasetMeta(str(DATA_DIR / "gsm8k_toy.jsonl"), data_slice=range(8)))
    dataset.map("GSM8KProcessor").set_template("Qwen3_5Template", model_id=str(tiny_model_dir))
    solutions = [trajectory.extra["solution"] for trajectory in dataset]  # type: ignore[union-attr]
    dataset.encode(add_generation_prompt=True)
    for feature, solution in zip(dataset, solutions, strict=True):
        assert (feature["labels"] == IGNORE_INDEX).all()  # type: ignore[index]
        assert math_accuracy_reward(solution, feature["extra"]["ground_truth"]) == 1.0  # type: ignore[index]


def test_pig_latin_pairs_train_on_the_completion_only(tiny_model_dir: Path) -> None:
    dataset = Dataset(DatasetMeta(str(DATA_DIR / "pig_latin.jsonl"), data_slice=range(3)))
    dataset.map("PigLatinProcessor").set_template("Template", model_id=str(tiny_model_dir)).encode()
    feature = dataset[0]
    assert dataset.template is not None
    assert dataset.template.decode(feature["labels"]) == " ananabay itsplay\n\n"  # type: ignore[index]


def test_latex_ocr_images_resolve_relative_to_the_data_and_encode_with_pixels(
    tiny_vision_model_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # the relative image paths must not depend on where the program runs
    dataset = Dataset(DatasetMeta(str(DATA_DIR / "latex_ocr")))
    assert len(dataset) == 8 and Path(dataset[0]["image"]).is_file()  # type: ignore[index]
    dataset.map("LatexOCRProcessor").set_template("Qwen3_5Template", model_id=str(tiny_vision_model_dir))
    dataset.encode(num_proc=2)
    feature = dataset[0]
    assert feature["pixel_values"].shape == (1, 3, 56, 56)  # type: ignore[index]
    assert dataset.template is not None
    assert dataset.template.decode(feature["labels"]) == "x^{2}+y^{2}=z^{2}"  # type: ignore[index]


def test_rows_survive_json_transport_and_rebuild_the_same_dataset(tiny_vision_model_dir: Path) -> None:
    dataset = Dataset(DatasetMeta(str(DATA_DIR / "latex_ocr"), data_slice=range(2))).map("LatexOCRProcessor")
    trajectories = json.loads(json.dumps(dataset.to_rows()))
    rebuilt = Dataset.from_rows(trajectories)
    assert rebuilt.kind == "trajectory" and list(rebuilt) == list(dataset)

    rebuilt.set_template("Qwen3_5Template", model_id=str(tiny_vision_model_dir)).encode()
    features = json.loads(json.dumps(rebuilt.to_rows()))
    again = Dataset.from_rows(features)
    assert again.kind == "feature"
    for before, after in zip(rebuilt, again, strict=True):
        np.testing.assert_array_equal(before["pixel_values"], after["pixel_values"])  # type: ignore[index]
        np.testing.assert_array_equal(before["labels"], after["labels"])  # type: ignore[index]


def test_local_directories_load_by_split_and_format(tmp_path: Path) -> None:
    rows = [{"query": f"q{i}", "response": f"r{i}"} for i in range(6)]
    datasets.Dataset.from_list(rows[:4]).to_parquet(tmp_path / "train-00000.parquet")
    datasets.Dataset.from_list(rows[4:]).to_parquet(tmp_path / "test-00000.parquet")
    assert [row["query"] for row in Dataset(DatasetMeta(str(tmp_path)))] == ["q0", "q1", "q2", "q3"]  # type: ignore[index]
    assert len(Dataset(DatasetMeta(str(tmp_path), split="test"))) == 2
    with pytest.raises(InvalidRequest, match="Its splits: test, train"):
        Dataset(DatasetMeta(str(tmp_path), split="validation"))
    (tmp_path / "train-extra.csv").write_text("query,response\nq9,r9\n")
    with pytest.raises(InvalidRequest, match="one format"):
        Dataset(DatasetMeta(str(tmp_path)))
    csv_only = tmp_path / "csv"
    csv_only.mkdir()
    (csv_only / "rows.csv").write_text("query,response\nq9,r9\n")
    assert Dataset(DatasetMeta(str(csv_only)))[0] == {"query": "q9", "response": "r9"}


def test_misuse_is_refused_with_what_to_do(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="hf://"):
        Dataset(DatasetMeta(str(tmp_path / "missing.jsonl")))
    raw = Dataset(DatasetMeta(SELF_COGNITION, data_slice=range(2)))
    with pytest.raises(InvalidRequest, match="set_template"):
        raw.encode()
    raw.set_template("Qwen3_5Template", model_id=str(tiny_model_dir))
    with pytest.raises(InvalidRequest, match="preprocessor"):
        raw.encode()
    raw.map("SelfCognitionProcessor", init_args={"model_name": "N", "model_author": "A"}).encode()
    with pytest.raises(InvalidRequest, match="already encoded"):
        raw.map("SelfCognitionProcessor", init_args={"model_name": "N", "model_author": "A"})


def test_hub_datasets_fail_clearly_when_the_hub_cannot_be_used(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("no route to the hub")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(InvalidRequest, match="Could not load dataset hf://openai/gsm8k") as raised:
        Dataset(DatasetMeta("hf://openai/gsm8k", subset_name="main"))
    assert "local path" in str(raised.value)
    monkeypatch.setitem(sys.modules, "modelscope", None)
    monkeypatch.setitem(sys.modules, "modelscope.msdatasets", None)
    with pytest.raises(InvalidRequest, match="needs the modelscope package"):
        Dataset(DatasetMeta("ms://swift/self-cognition", data_slice=range(500)))


def test_an_identical_encode_is_read_back_from_the_cache_and_a_changed_one_is_not(
    tiny_model_dir: Path,
) -> None:
    def encoded(max_length: int) -> Dataset:
        dataset = Dataset(DatasetMeta(SELF_COGNITION, data_slice=range(10)))
        dataset.set_template("Qwen3_5Template", model_id=str(tiny_model_dir), max_length=max_length)
        return dataset.map(
            "SelfCognitionProcessor", init_args={"model_name": "N", "model_author": "A"}
        ).encode()

    first, again, shorter = encoded(512), encoded(512), encoded(16)
    assert first._table.cache_files == again._table.cache_files
    assert first._table.cache_files != shorter._table.cache_files
    assert again.to_rows() == first.to_rows() != shorter.to_rows()
