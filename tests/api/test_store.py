"""The API's view of the broker: when it started, so a request it lost reads as lost, not unknown; the tenant's
weight on every future record; the tier's training-run cap next to the server's model limit."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from api.store import READ_AHEAD_RESULTS, Store, broker_start_time
from tests.harness import REDIS_HOST, REDIS_PORT, async_redis
from twinkle import blobs
from twinkle.celery_app import make_celery
from twinkle.errors import AdapterGone, Expired, LimitExceeded, NotFound, QuotaExceeded
from twinkle.futures import Op, new_request_id
from twinkle.keys import Keys
from twinkle.records import ModelRecord, SamplingSessionRecord
from twinkle.tenancy import TenantPolicy


def test_the_broker_start_time_is_never_before_the_real_start_whatever_second_it_is_read_in() -> None:
    real_start = 1_000.7
    for tenths in range(1, 60):  # INFO read 0.1 s to 6 s after the start
        now = real_start + tenths / 10
        info = {"server_time_usec": int(now * 1e6), "uptime_in_seconds": int(now) - int(real_start)}
        assert real_start <= broker_start_time(info) <= real_start + 1


def test_a_request_accepted_just_before_a_restart_counts_as_before_it() -> None:
    # the case that read as `not_found`: accepted 0.2 s before a restart at x.9, checked at y.3
    accepted, restarted = 1_000.7, 1_000.9
    info = {"server_time_usec": int(1_004.3 * 1e6), "uptime_in_seconds": 1_004 - 1_000}
    assert accepted < broker_start_time(info)
    assert not accepted < 1_004.3 - info["uptime_in_seconds"]  # what `now - uptime` said
    assert restarted <= broker_start_time(info)


class SentTasks:
    """Stands in for Celery: remembers what would have been published."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send_task(self, name: str, **kwargs: Any) -> None:
        self.sent.append({"name": name, **kwargs})


@pytest.fixture
async def store() -> AsyncIterator[Store]:
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    async with async_redis(db=2) as r:
        yield Store(r, Keys(prefix), SentTasks(), future_ttl=60, session_ttl=60)  # type: ignore[arg-type]
        async for key in r.scan_iter(f"{prefix}*"):
            await r.delete(key)


async def test_a_submitted_op_carries_the_tenants_weight_on_its_future_record(store: Store) -> None:
    rid = await store.submit(op=Op.FORWARD_BACKWARD, owner="alice", model_id="m1", queue="model.q.0", payload=None,
                             weight=2.5)
    assert (await store.future(rid, "alice")).weight == 2.5
    default = await store.submit(op=Op.FORWARD_BACKWARD, owner="bob", model_id="m2", queue="model.q.0", payload=None)
    assert (await store.future(default, "bob")).weight == 1.0


def model(owner: str, n: int) -> ModelRecord:
    return ModelRecord(model_id=f"{owner}-run-{n}", owner=owner, session_id="s", base_model="tiny", app="models",
                       queue="model.q.0", lora={}, created_at=0.0, last_request_at=0.0)


async def test_a_models_submits_read_it_once_and_one_after_its_unload_fails_as_reading_it_would(
        store: Store) -> None:
    record = model("alice", 1)
    await store.add_model(record, limit=0)
    kept = await store.model_to_submit(record.model_id, "alice")
    await store.r.delete(store.keys.model(record.model_id))  # not read again: a submit checks it in its script
    assert await store.model_to_submit(record.model_id, "alice") is kept
    with pytest.raises(NotFound):  # another owner's is never served from what was kept
        await store.model_to_submit(record.model_id, "bob")
    await store.add_model(record, limit=0)
    first = await store.submit(op=Op.OPTIM_STEP, owner="alice", model_id=record.model_id, queue=record.queue,
                               payload=None, check_model=True)
    assert (await store.future(first, "alice")).op == Op.OPTIM_STEP
    await store.release_model(record, reason="its session ended")
    with pytest.raises(AdapterGone) as refused:
        await store.submit(op=Op.OPTIM_STEP, owner="alice", model_id=record.model_id, queue=record.queue,
                           payload=None, check_model=True)
    with pytest.raises(AdapterGone) as read:
        await store.model(record.model_id, "alice")
    assert str(refused.value) == str(read.value) and "its session ended" in str(read.value)
    assert await store.r.zcard(store.keys.owner_futures("alice")) == 1  # the refused op left nothing behind


async def test_a_sampling_session_is_read_once_and_only_its_owner_is_served_from_what_was_kept(store: Store) -> None:
    record = SamplingSessionRecord(sampling_session_id=f"s{uuid.uuid4().hex[:6]}:sample:0", owner="alice",
                                   session_id="s", base_model="tiny", queue="model.q.0")
    with pytest.raises(NotFound):  # none yet: nothing is kept of a miss
        await store.sampling_session(record.sampling_session_id, "alice")
    await store.add_sampling_session(record)
    kept = await store.sampling_session(record.sampling_session_id, "alice")
    assert kept == record
    await store.r.delete(store.keys.sampling_session(record.sampling_session_id))
    assert await store.sampling_session(record.sampling_session_id, "alice") is kept
    with pytest.raises(NotFound):
        await store.sampling_session(record.sampling_session_id, "bob")


async def test_the_tiers_training_run_cap_and_the_servers_model_limit_combine_and_the_smaller_wins(
        store: Store) -> None:
    capped = TenantPolicy(tier="free", max_training_runs=1)
    await store.add_model(model("alice", 0), limit=3, policy=capped)
    with pytest.raises(QuotaExceeded, match=r"1 active training runs.*'free' allows 1") as refused:
        await store.add_model(model("alice", 1), limit=3, policy=capped)
    assert refused.value.status_code == 403
    await store.release_model(model("alice", 0), reason="unloaded by its owner")
    await store.add_model(model("alice", 1), limit=3, policy=capped)  # a freed run makes room again

    roomy = TenantPolicy(tier="gold", max_training_runs=5)
    for n in range(2):
        await store.add_model(model("bob", n), limit=2, policy=roomy)
    with pytest.raises(LimitExceeded, match="2 active models"):  # the server's limit is the smaller one
        await store.add_model(model("bob", 2), limit=2, policy=roomy)
    for n in range(3):
        await store.add_model(model("carol", n), limit=0, policy=TenantPolicy(max_training_runs=3))
    with pytest.raises(QuotaExceeded):
        await store.add_model(model("carol", 3), limit=0, policy=TenantPolicy(max_training_runs=3))


@pytest.fixture
async def sending_store() -> AsyncIterator[tuple[Store, str]]:
    """A store whose submit script pushes each op's broker message itself, on a queue of the test's own holding
    at most two ops of each key (the rest wait in the key's backlog)."""
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    queue = f"model.{prefix}pool.0"
    celery = make_celery(f"redis://{REDIS_HOST}:{REDIS_PORT}/2", events=False)
    async with async_redis(db=2) as r:
        yield Store(r, Keys(prefix), celery, future_ttl=60, session_ttl=60, backlog_windows={queue: 2},
                    direct_send=True), queue
        async for key in r.scan_iter(f"{prefix}*"):
            await r.delete(key)
        await r.delete(queue)


def pushed_ids(raw_messages: list[bytes]) -> list[str]:
    return [json.loads(raw)["headers"]["id"] for raw in reversed(raw_messages)]  # oldest first


async def test_a_submit_writes_the_record_and_pushes_the_ops_broker_message_in_one_script(
        sending_store: tuple[Store, str]) -> None:
    store, queue = sending_store
    rid = await store.submit(op=Op.OPTIM_STEP, owner="alice", model_id="m1", queue=queue, payload={"lr": 1e-4})
    [message] = await store.r.lrange(queue, 0, -1)
    assert json.loads(message)["headers"]["task"] == "twinkle.optim_step"
    assert json.loads(message)["headers"]["id"] == rid
    assert (await store.future(rid, "alice")).status == "queued"


async def test_a_retried_submit_gets_the_first_ones_future_and_pushes_no_second_message(
        sending_store: tuple[Store, str]) -> None:
    store, queue = sending_store
    first = await store.submit(op=Op.FORWARD_BACKWARD, owner="alice", model_id="m1", queue=queue, payload=None,
                               seq_id=7)
    again = await store.submit(op=Op.FORWARD_BACKWARD, owner="alice", model_id="m1", queue=queue, payload=None,
                               seq_id=7)
    assert again == first
    assert pushed_ids(await store.r.lrange(queue, 0, -1)) == [first]


async def test_a_submit_script_sent_twice_with_one_request_id_stores_and_pushes_its_op_once(
        sending_store: tuple[Store, str]) -> None:
    """What redis-py does when the script's reply was lost to a broken connection: it sends the script again."""
    store, queue = sending_store
    rid = new_request_id()
    for _ in range(2):
        assert await store.submit(op=Op.OPTIM_STEP, owner="alice", model_id="m1", queue=queue, payload=None,
                                  request_id=rid) == rid
    assert pushed_ids(await store.r.lrange(queue, 0, -1)) == [rid]
    assert (await store.future(rid, "alice")).ticket == 1


async def test_an_op_past_its_keys_share_of_the_queue_waits_in_the_backlog_and_pushes_no_message(
        sending_store: tuple[Store, str]) -> None:
    store, queue = sending_store
    rids = [await store.submit(op=Op.FORWARD_BACKWARD, owner="alice", model_id="m1", queue=queue, payload=None)
            for _ in range(3)]
    assert pushed_ids(await store.r.lrange(queue, 0, -1)) == rids[:2]
    [parked] = await store.r.lrange(store.backlog.parked(queue, "alice"), 0, -1)
    assert parked.decode().split()[0] == rids[2]


async def completed(store: Store, owner: str, result: Any) -> str:
    rid = await store.submit(op=Op.OPTIM_STEP, owner=owner, model_id="m1", queue="model.q.0", payload=None)
    await store.r.hset(store.keys.future(rid), "status", "completed")
    await store.r.set(store.keys.blob_out(rid), blobs.dumps(result))
    return rid


async def test_a_completed_futures_result_is_read_with_its_record(store: Store) -> None:
    rid = await completed(store, "alice", {"metrics": {"loss:sum": 1.5}})
    assert (await store.future(rid, "alice")).status == "completed"
    await store.r.delete(store.keys.blob_out(rid))  # after the record's read: its result came with it
    assert await store.result(rid) == {"metrics": {"loss:sum": 1.5}}
    with pytest.raises(Expired):  # taken once: a later ask reads the broker again
        await store.result(rid)


async def test_results_read_with_their_records_and_never_asked_for_are_let_go(store: Store) -> None:
    oldest = await completed(store, "alice", "oldest")
    await store.future(oldest, "alice")
    for n in range(READ_AHEAD_RESULTS):
        await store.future(await completed(store, "alice", n), "alice")
    await store.r.delete(store.keys.blob_out(oldest))
    with pytest.raises(Expired):
        await store.result(oldest)


def unloaded_run(owner: str, run_id: str) -> ModelRecord:
    return ModelRecord(model_id=run_id, owner=owner, session_id="", base_model="tiny", app="", queue="", lora={},
                       created_at=1.0, last_request_at=1.0, status="unloaded")


async def test_a_run_made_of_checkpoints_is_listed_with_its_index_entries_and_holds_no_slot(store: Store) -> None:
    entry = {"checkpoint_id": "weights/a", "tinker_path": "tinker://copy-1/weights/a", "time": 1.0}
    await store.add_unloaded_run(unloaded_run("alice", "copy-1"), {"weights/a": entry},
                                 answer=(store.keys.idempotency("alice", "k"), entry["tinker_path"], 60))
    assert [run.model_id for run in await store.list_runs("alice")] == ["copy-1"]
    assert await store.checkpoints("copy-1") == [entry]
    assert await store.idempotent_answer(store.keys.idempotency("alice", "k")) == "tinker://copy-1/weights/a"
    assert not await store.r.smembers(store.keys.owner_models("alice"))  # counts against no model limit


async def test_a_checkpoints_index_entry_is_written_read_and_deleted(store: Store) -> None:
    assert await store.checkpoint_entry("run-1", "weights/a") is None
    await store.put_checkpoint_entry("run-1", "weights/a", {"public": True})
    assert await store.checkpoint_entry("run-1", "weights/a") == {"public": True}
    await store.delete_checkpoint_entry("run-1", "weights/a")
    assert await store.checkpoint_entry("run-1", "weights/a") is None


async def test_a_dedupe_record_is_forgotten_only_when_its_future_failed_or_is_gone(store: Store) -> None:
    for status, kept in (("running", True), ("failed", False)):
        await store.r.set(store.keys.dedupe("scope", 1), "r1")
        await store.r.hset(store.keys.future("r1"), "status", status)
        await store.forget_failed_dedupe("scope", 1)
        assert bool(await store.r.exists(store.keys.dedupe("scope", 1))) is kept
    await store.r.set(store.keys.dedupe("scope", 1), "gone")
    await store.forget_failed_dedupe("scope", 1)
    assert not await store.r.exists(store.keys.dedupe("scope", 1))
