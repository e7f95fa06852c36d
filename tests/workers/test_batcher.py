from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import pytest

from twinkle.errors import InvalidRequest
from twinkle.types import SampledSequence, SampleOutput, SampleRequest, chunks_from_tokens
from workers.batcher import SampleBatcher


class RecordingSampler:
    """Echoes each prompt's first token; slow enough that concurrent requests pile up."""

    def __init__(self) -> None:
        self.batch_sizes: list[int] = []

    def sample(self, requests: list[SampleRequest]) -> list[SampleOutput]:
        self.batch_sizes.append(len(requests))
        time.sleep(0.05)
        outputs = []
        for req in requests:
            first = int(req.prompt[0].tokens[0])  # type: ignore[union-attr]
            if first < 0:
                raise InvalidRequest("negative token")
            outputs.append(SampleOutput([SampledSequence([first], [0.0], "length")]))
        return outputs


def request(token: int) -> SampleRequest:
    return SampleRequest(prompt=chunks_from_tokens([token]))


def test_concurrent_requests_share_batches_and_each_gets_its_own_answer() -> None:
    sampler = RecordingSampler()
    batcher = SampleBatcher(sampler, max_batch=8)
    results: dict[int, int] = {}

    def ask(token: int) -> None:
        results[token] = batcher.sample(request(token)).sequences[0].tokens[0]

    threads = [threading.Thread(target=ask, args=(t,)) for t in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {t: t for t in range(16)}
    assert max(sampler.batch_sizes) > 1 and max(sampler.batch_sizes) <= 8


def test_a_bad_request_fails_alone_and_its_batch_mates_still_succeed() -> None:
    batcher = SampleBatcher(RecordingSampler(), max_batch=8)
    outcomes: dict[int, object] = {}

    def ask(token: int) -> None:
        try:
            outcomes[token] = batcher.sample(request(token)).sequences[0].tokens[0]
        except InvalidRequest as exc:
            outcomes[token] = exc

    threads = [threading.Thread(target=ask, args=(t,)) for t in (-1, 1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert isinstance(outcomes[-1], InvalidRequest)
    assert [outcomes[t] for t in (1, 2, 3)] == [1, 2, 3]


def test_a_sampler_error_reaches_the_caller() -> None:
    with pytest.raises(InvalidRequest):
        SampleBatcher(RecordingSampler()).sample(request(-5))


class ServingSampler:
    """A continuous sampler: records what each call of `take` handed it and answers at once."""

    def __init__(self) -> None:
        self.takes: list[int] = []

    def serve(self, take: Callable[[], list[tuple[SampleRequest, Future[SampleOutput]]]]) -> None:
        while jobs := take():
            self.takes.append(len(jobs))
            for req, done in jobs:
                done.set_result(SampleOutput([SampledSequence([int(req.prompt[0].tokens[0])], [0.0], "length")]))  # type: ignore[union-attr]


def test_a_burst_of_requests_starts_one_generation_together_instead_of_one_then_the_rest() -> None:
    sampler = ServingSampler()
    batcher = SampleBatcher(sampler)
    results: dict[int, int] = {}

    def ask(token: int) -> None:
        results[token] = batcher.sample(request(token)).sequences[0].tokens[0]

    threads = [threading.Thread(target=ask, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
        time.sleep(0.001)  # a burst, as the requests of concurrent clients reach the pool
    for t in threads:
        t.join()
    assert results == {t: t for t in range(8)}
    assert sampler.takes[0] > 1


class OrderRecordingSampler(RecordingSampler):
    """Records the order requests reach it in; holds every batch until `gate` opens."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[int] = []
        self.gate = threading.Event()

    def sample(self, requests: list[SampleRequest]) -> list[SampleOutput]:
        self.order += [int(req.prompt[0].tokens[0]) for req in requests]  # type: ignore[union-attr]
        self.gate.wait(timeout=10)
        return super().sample(requests)


@pytest.mark.parametrize("fair", [True, False])
def test_a_tenants_burst_does_not_keep_another_tenants_request_out_of_the_batches(fair: bool) -> None:
    sampler = OrderRecordingSampler()
    batcher = SampleBatcher(sampler, max_batch=2, fair=fair)
    threads = [threading.Thread(target=batcher.sample, args=(request(100 + i),), kwargs={"tenant": "burst"})
               for i in range(12)]
    for thread in threads:
        thread.start()
        time.sleep(0.002)  # the burst arrives first, in order, while its first batch is held at the gate
    time.sleep(0.06)
    light = threading.Thread(target=batcher.sample, args=(request(1),), kwargs={"tenant": "light"})
    light.start()
    time.sleep(0.06)
    sampler.gate.set()
    for thread in [*threads, light]:
        thread.join(timeout=10)
    position = sampler.order.index(1)
    if fair:  # it goes in the first batch after the one already at the gate
        assert position <= 3
    else:  # arrival order: behind the whole burst
        assert position == 12
