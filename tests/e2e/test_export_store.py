"""Checkpoint downloads from an S3-compatible store (storage.export_store) with the real Tinker SDK 0.38 and a
launched server on the transformers backend; the store is moto's S3 served over real HTTP (issue 14, item 2).

The server has a redis-server of its own (tests/private_redis.py): every database of the shared Redis is taken,
`launch` empties the database it is given, and Celery's own keys carry no prefix, so no shared database fits.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import httpx
import numpy as np
import pytest
import tinker

from tests.e2e.test_weight_export import KEY, OTHER, TOKENS, datum, rest, trained_client
from tests.harness import LaunchedServer, free_port, mock_config
from tests.private_redis import PrivateRedis
from twinkle.auth import tenant_id

boto3 = pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
BUCKET = "twinkle-exports"
PREFIX = "exports/"
TTL = 900
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    s3(endpoint).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedis]:
    redis_server = PrivateRedis(tmp_path_factory.mktemp("export-store-redis"))
    redis_server.start()
    yield redis_server
    redis_server.kill()


def launched(tmp: Path, model_dir: Path, broker: PrivateRedis, db: int, store: dict[str, Any],
             **kw: Any) -> LaunchedServer:
    config = mock_config(model_dir, tmp / "checkpoints", port=free_port(), db=db, **kw)
    config["broker"]["url"] = broker.url.rsplit("/", 1)[0] + f"/{db}"
    config["storage"].update(download_url_ttl_seconds=TTL, export_store=store)
    return LaunchedServer(config, tmp / "server.yaml", tmp / "server.log",
                          env={"OMP_NUM_THREADS": "1", **CREDENTIALS})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, broker: PrivateRedis,
           s3_endpoint: str) -> Iterator[LaunchedServer]:
    launch = launched(tmp_path_factory.mktemp("export-store"), tiny_model_dir, broker, 0, backend="transformers",
                      store={"bucket": BUCKET, "endpoint_url": s3_endpoint, "key_prefix": PREFIX})
    launch.start()
    yield launch
    launch.stop()


def s3(endpoint: str) -> Any:
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def objects(endpoint: str, prefix: str = PREFIX) -> list[str]:
    listed = s3(endpoint).list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"] for o in listed)


def archive(server: LaunchedServer, path: str, key: str = KEY) -> httpx.Response:
    run, _, checkpoint_id = path.removeprefix("tinker://").partition("/")
    with server.client(key) as client:
        return client.get(f"/training_runs/{run}/checkpoints/{checkpoint_id}/archive")


def checkpoint_prefix(path: str, key: str = KEY) -> str:
    return f"{PREFIX}{tenant_id(key)}/{path.removeprefix('tinker://')}/"


def test_the_archive_is_a_presigned_url_of_the_bucket_whose_tar_loads_with_peft(
        server: LaunchedServer, s3_endpoint: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tc = trained_client(server, steps=2)
    server_logprobs = tc.forward([datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    path = tc.save_weights_external("peft").result().path

    answer = archive(server, path)
    assert answer.status_code == 302 and answer.json()["url"] == answer.headers["Location"]
    url = answer.headers["Location"]
    assert unquote(url).startswith(f"{s3_endpoint}/{BUCKET}/{checkpoint_prefix(path)}")
    # moto does not enforce a presigned URL's expiry, so check what S3 enforces: signed at X-Amz-Date, valid for
    # X-Amz-Expires seconds, which is the lifetime of the API's own URLs and the Expires the API answers
    query = parse_qs(urlsplit(url).query)
    signed_at = datetime.strptime(query["X-Amz-Date"][0], "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
    assert query["X-Amz-Expires"] == [str(TTL)] and "X-Amz-Signature" in query
    expires = parsedate_to_datetime(answer.headers["Expires"])
    assert abs((expires - signed_at).total_seconds() - TTL) <= 5
    assert abs((expires - datetime.now(UTC)).total_seconds() - TTL) <= 30

    download = httpx.get(url, timeout=30)  # no API key: the URL is the credential
    assert download.status_code == 200 and int(download.headers["Content-Length"]) == len(download.content)
    with tarfile.open(fileobj=io.BytesIO(download.content)) as tar:
        tar.extractall(tmp_path / "archive", filter="data")
    adapter = tmp_path / "archive" / "peft"
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert len(objects(s3_endpoint, checkpoint_prefix(path))) == 1
    assert archive(server, path).status_code == 302 and len(objects(s3_endpoint, checkpoint_prefix(path))) == 1

    files = rest(server).get_external_weights_urls(path).result().urls  # the per-file URLs come from the bucket
    assert sorted(files) == ["adapter_config.json", "adapter_model.safetensors"]
    for name, file_url in files.items():
        assert file_url.startswith(f"{s3_endpoint}/{BUCKET}/")
        assert httpx.get(file_url, timeout=30).content == (adapter / name).read_bytes()

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS[:-1]])).logits[0].float()
    local = torch.log_softmax(logits, dim=-1)[torch.arange(len(TOKENS) - 1), torch.tensor(TOKENS[1:])].numpy()
    np.testing.assert_allclose(local, server_logprobs, atol=1e-4)


def test_another_tenant_gets_nothing_and_deleting_the_checkpoint_removes_its_objects(
        server: LaunchedServer, s3_endpoint: str) -> None:
    tc = trained_client(server, steps=1)
    path = tc.save_state("shared-name").result().path
    url = archive(server, path).headers["Location"]
    assert httpx.get(url, timeout=30).status_code == 200

    assert archive(server, path, OTHER).status_code == 404
    with pytest.raises(tinker.NotFoundError):
        rest(server, OTHER).get_weights_info_by_tinker_path(path).result()
    assert objects(s3_endpoint, f"{PREFIX}{tenant_id(OTHER)}/") == []

    rest(server).delete_checkpoint_from_tinker_path(path).result()
    assert objects(s3_endpoint, checkpoint_prefix(path)) == []
    assert httpx.get(url, timeout=30).status_code in (403, 404)  # S3 says 403 for a missing key without ListBucket


def test_a_bucket_that_is_gone_is_a_clear_502_and_launch_refuses_one_that_does_not_exist(
        server: LaunchedServer, s3_endpoint: str, tiny_model_dir: Path, broker: PrivateRedis,
        tmp_path: Path) -> None:
    path = trained_client(server, steps=1).save_state("no-bucket").result().path
    client = s3(s3_endpoint)
    for key in objects(s3_endpoint):
        client.delete_object(Bucket=BUCKET, Key=key)
    client.delete_bucket(Bucket=BUCKET)
    try:
        answer = archive(server, path)
    finally:
        client.create_bucket(Bucket=BUCKET)
    assert answer.status_code == 502 and answer.json()["code"] == "export_store_unavailable"
    assert f"bucket {BUCKET!r} at {s3_endpoint}: it does not exist" in answer.json()["error"]
    assert "Traceback" not in answer.text

    missing = launched(tmp_path, tiny_model_dir, broker, 1,
                       store={"bucket": "no-such-bucket", "endpoint_url": s3_endpoint})
    with pytest.raises(RuntimeError, match="server exited early") as info:
        missing.start(timeout=60)
    assert "error: The checkpoint export store could not reach bucket 'no-such-bucket'" in str(info.value)
    assert "create it or fix storage.export_store.bucket" in str(info.value)
