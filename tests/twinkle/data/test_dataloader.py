from __future__ import annotations

import pytest

from twinkle.dataloader import DataLoader
from twinkle.errors import InvalidRequest


def served(loader: DataLoader, epochs: int = 1) -> list[list[int]]:
    return [batch for _ in range(epochs) for batch in loader]


@pytest.mark.parametrize(("drop_last", "batches"), [(False, 4), (True, 3)])
def test_len_counts_the_batches_of_one_epoch(drop_last: bool, batches: int) -> None:
    loader = DataLoader(list(range(10)), batch_size=3, drop_last=drop_last)
    assert len(loader) == batches == len(served(loader))


def test_an_epoch_serves_every_row_once_in_order_unless_shuffled() -> None:
    assert served(DataLoader(list(range(7)), batch_size=3)) == [[0, 1, 2], [3, 4, 5], [6]]
    shuffled = served(DataLoader(list(range(7)), batch_size=3, shuffle=True, seed=1), epochs=2)
    first = [row for batch in shuffled[:3] for row in batch]
    second = [row for batch in shuffled[3:] for row in batch]
    assert sorted(first) == sorted(second) == list(range(7))
    assert first != second  # each epoch has its own order


def test_consumed_train_samples_counts_samples_over_epochs() -> None:
    loader = DataLoader(list(range(10)), batch_size=4)
    served(loader, epochs=2)
    assert loader.get_state()["consumed_train_samples"] == 20
    assert loader.get_state()["epoch"] == 2


@pytest.mark.parametrize("consumed", [0, 3, 4, 10, 13, 27])
@pytest.mark.parametrize("drop_last", [False, True])
def test_resuming_serves_exactly_what_an_uninterrupted_run_served_next(
    consumed: int, drop_last: bool
) -> None:
    def loader() -> DataLoader:
        return DataLoader(list(range(10)), batch_size=4, shuffle=True, seed=3, drop_last=drop_last)

    uninterrupted = [row for batch in served(loader(), epochs=4) for row in batch]
    resumed = loader()
    resumed.resume_from_checkpoint(consumed)
    per_epoch = resumed.samples_per_epoch
    epochs_left = 4 - consumed // per_epoch
    rows = [row for batch in served(resumed, epochs=epochs_left) for row in batch]
    if drop_last and consumed % 4:
        # Resumed mid-batch: batches stay whole, so the epoch's short tail is dropped.
        epoch_end = (consumed // per_epoch + 1) * per_epoch
        expected = (
            uninterrupted[consumed : epoch_end - (epoch_end - consumed) % 4] + uninterrupted[epoch_end:]
        )
    else:
        expected = uninterrupted[consumed:]
    assert rows == expected


def test_a_loop_that_stops_early_continues_where_it_stopped() -> None:
    loader = DataLoader(list(range(10)), batch_size=3)
    first = next(iter(loader))
    assert first == [0, 1, 2] and loader.get_state()["consumed_train_samples"] == 3
    assert served(loader) == [[3, 4, 5], [6, 7, 8], [9]]
    assert served(loader)[0] == [0, 1, 2]  # and the next loop is a new epoch


def test_saved_state_restores_a_fresh_loader_mid_epoch() -> None:
    original = DataLoader(list(range(20)), batch_size=4, shuffle=True, seed=9)
    iterator = iter(original)
    next(iterator), next(iterator)
    restored = DataLoader(list(range(20)), batch_size=4, shuffle=True, seed=9)
    restored.resume_from_checkpoint(original.get_state()["consumed_train_samples"])
    assert served(restored) == list(iterator)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(InvalidRequest):
        DataLoader([1], batch_size=0)
    with pytest.raises(InvalidRequest):
        DataLoader([1]).resume_from_checkpoint(-1)
