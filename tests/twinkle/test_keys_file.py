"""The keys file: one key per line, with an optional tier and weight after the created date; older files read."""

from __future__ import annotations

from pathlib import Path

import pytest

from twinkle.auth import hash_key, read_keys_file
from twinkle.errors import InvalidRequest, NotFound
from twinkle.keys_file import KeyEntry, add_key, parse_line, read_entries, revoke, set_tier

HASH = hash_key("tml-a")


@pytest.mark.parametrize(("line", "entry"), [
    (HASH, KeyEntry(HASH)),
    (f"{HASH} alice", KeyEntry(HASH, "alice")),
    (f"{HASH} alice 2025-01-02T03:04:05Z", KeyEntry(HASH, "alice", "2025-01-02T03:04:05Z")),
    (f"{HASH} - 2025-01-02T03:04:05Z", KeyEntry(HASH, "", "2025-01-02T03:04:05Z")),
    (f"{HASH} alice 2025-01-02T03:04:05Z tier=gold", KeyEntry(HASH, "alice", "2025-01-02T03:04:05Z", "gold")),
    (f"{HASH} alice 2025-01-02T03:04:05Z tier=gold weight=2.5",
     KeyEntry(HASH, "alice", "2025-01-02T03:04:05Z", "gold", 2.5)),
    (f"{HASH} alice - weight=0.5", KeyEntry(HASH, "alice", "", "", 0.5)),
    (f"{HASH.upper()} alice 2025-01-02T03:04:05Z tier=gold  # the gold customer",
     KeyEntry(HASH, "alice", "2025-01-02T03:04:05Z", "gold")),
])
def test_lines_of_every_format_read_as_their_entries(line: str, entry: KeyEntry) -> None:
    assert parse_line(line) == entry


def test_blank_and_comment_lines_hold_no_entry() -> None:
    assert parse_line("") is None and parse_line("   # just a note") is None


@pytest.mark.parametrize("option", ["weight=abc", "weight=0", "weight=-1", "weight=nan", "weight=1001",
                                    "tier=", "tier=-", "tier=a/b"])
def test_a_malformed_tier_or_weight_is_ignored_and_the_key_stays_valid(option: str) -> None:
    entry = parse_line(f"{HASH} alice 2025-01-02T03:04:05Z {option}")
    assert entry == KeyEntry(HASH, "alice", "2025-01-02T03:04:05Z")


def test_unknown_fields_from_a_newer_version_are_ignored() -> None:
    assert parse_line(f"{HASH} alice 2025-01-02T03:04:05Z tier=gold colour=blue") == KeyEntry(
        HASH, "alice", "2025-01-02T03:04:05Z", "gold")


@pytest.mark.parametrize("entry", [
    KeyEntry(HASH), KeyEntry(HASH, "alice"), KeyEntry(HASH, "alice", "2025-01-02T03:04:05Z"),
    KeyEntry(HASH, "", "", "gold"), KeyEntry(HASH, "alice", "", "", 3.0),
    KeyEntry(HASH, "alice", "2025-01-02T03:04:05Z", "gold", 0.25),
])
def test_every_entry_round_trips_through_its_line(entry: KeyEntry) -> None:
    assert parse_line(entry.line()) == entry


def test_a_file_with_tiers_still_reads_as_hashes_for_read_keys_file(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    gold, _ = add_key(keys_file, "gold-customer", tier="gold", weight=2)
    plain, _ = add_key(keys_file, "plain")
    assert read_keys_file(keys_file) == {hash_key(gold), hash_key(plain)}
    assert [(e.label, e.tier, e.weight) for e in read_entries(keys_file)] == [
        ("gold-customer", "gold", 2.0), ("plain", "", None)]


def test_add_refuses_a_bad_tier_name_or_weight_before_writing(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    with pytest.raises(InvalidRequest, match="tier name"):
        add_key(keys_file, "a", tier="gold tier")
    with pytest.raises(InvalidRequest, match="weight"):
        add_key(keys_file, "a", weight=0)
    assert not keys_file.exists()


def test_set_changes_a_keys_tier_and_weight_and_keeps_the_rest(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    raw, added = add_key(keys_file, "alice")
    add_key(keys_file, "bob", tier="silver")
    changed = set_tier(keys_file, "alice", tier="gold", weight=2)
    assert changed == KeyEntry(added.key_hash, "alice", added.created, "gold", 2.0)
    assert set_tier(keys_file, hash_key(raw)[:8], weight=3).tier == "gold"  # by hash prefix; the tier stays
    assert set_tier(keys_file, "alice", tier="-").weight == 3.0  # back to the default tier; the weight stays
    assert set_tier(keys_file, "alice", weight=0) == KeyEntry(added.key_hash, "alice", added.created)
    assert [e.tier for e in read_entries(keys_file)] == ["", "silver"]
    with pytest.raises(NotFound):
        set_tier(keys_file, "carol", tier="gold")


def test_revoke_still_finds_keys_by_label_and_hash_prefix(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    raw, _ = add_key(keys_file, "alice", tier="gold")
    add_key(keys_file, "bob", weight=2)
    assert [e.label for e in revoke(keys_file, hash_key(raw)[:8])] == ["alice"]
    assert [e.label for e in read_entries(keys_file)] == ["bob"]
