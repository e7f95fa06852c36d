"""`twinkle-server keys add|list|set|revoke`."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from twinkle.auth import hash_key, read_keys_file
from twinkle.keys_file import read_entries
from twinkle.server.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main


def test_add_prints_the_key_once_and_stores_only_its_hash(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys_file = tmp_path / "keys"
    assert main(["keys", "add", "--label", "alice", "--keys-file", str(keys_file)]) == EXIT_OK
    out, err = capsys.readouterr()
    raw = out.strip()
    assert raw.startswith("tw-") and "only time" in err
    assert read_keys_file(keys_file) == {hash_key(raw)}
    assert raw not in keys_file.read_text() and raw not in err


def test_list_shows_hash_prefixes_labels_and_times(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys_file = tmp_path / "keys"
    main(["keys", "add", "--label", "alice", "--keys-file", str(keys_file)])
    raw = capsys.readouterr().out.strip()
    assert main(["keys", "list", "--keys-file", str(keys_file)]) == EXIT_OK
    line = capsys.readouterr().out.strip()
    prefix, label, created = line.split()
    assert hash_key(raw).startswith(prefix) and len(prefix) == 12
    assert label == "alice" and created.endswith("Z")
    assert raw not in line


def test_revoke_by_label_or_hash_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys_file = tmp_path / "keys"
    for label in ("alice", "bob"):
        main(["keys", "add", "--label", label, "--keys-file", str(keys_file)])
    main(["keys", "add", "--prefix", "tml-", "--keys-file", str(keys_file)])
    _, bob, carol = capsys.readouterr().out.split()
    assert carol.startswith("tml-")
    assert main(["keys", "revoke", "alice", "--keys-file", str(keys_file)]) == EXIT_OK
    assert main(["keys", "revoke", hash_key(carol)[:8], "--keys-file", str(keys_file)]) == EXIT_OK
    assert read_keys_file(keys_file) == {hash_key(bob)}
    assert main(["keys", "revoke", "alice", "--keys-file", str(keys_file)]) == EXIT_FAILED
    assert "No key" in capsys.readouterr().err


def test_a_duplicate_label_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys_file = tmp_path / "keys"
    main(["keys", "add", "--label", "alice", "--keys-file", str(keys_file)])
    assert main(["keys", "add", "--label", "alice", "--keys-file", str(keys_file)]) == EXIT_FAILED
    assert "already exists" in capsys.readouterr().err
    assert len(read_keys_file(keys_file)) == 1


def test_the_keys_file_comes_from_the_config_when_not_given(tmp_path: Path, tiny_config: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "add", "-c", str(tiny_config)]) == EXIT_OK
    raw = capsys.readouterr().out.strip()
    assert read_keys_file(tmp_path / "from-config.keys") == {hash_key(raw)}


def test_without_a_keys_file_anywhere_it_says_what_to_pass(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("TWINKLE_SERVER_CONFIG", raising=False)
    with pytest.raises(SystemExit) as exited:
        main(["keys", "list"])
    assert exited.value.code == 2
    assert "--keys-file" in capsys.readouterr().err


def test_add_puts_the_key_in_a_tier_with_a_weight_of_its_own(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    keys_file = tmp_path / "keys"
    assert main(["keys", "add", "--label", "alice", "--tier", "gold", "--weight", "2.5",
                 "--keys-file", str(keys_file)]) == EXIT_OK
    raw = capsys.readouterr().out.strip()
    (entry,) = read_entries(keys_file)
    assert (entry.key_hash, entry.tier, entry.weight) == (hash_key(raw), "gold", 2.5)
    assert main(["keys", "list", "--keys-file", str(keys_file)]) == EXIT_OK
    assert capsys.readouterr().out.split()[3:] == ["tier=gold", "weight=2.5"]


def test_set_changes_an_existing_keys_tier_and_weight_and_can_undo_them(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    keys_file = tmp_path / "keys"
    main(["keys", "add", "--label", "alice", "--keys-file", str(keys_file)])
    raw = capsys.readouterr().out.strip()
    assert main(["keys", "set", "alice", "--tier", "gold", "--weight", "2", "--keys-file", str(keys_file)]) == EXIT_OK
    assert "tier=gold" in capsys.readouterr().out
    assert [(e.tier, e.weight) for e in read_entries(keys_file)] == [("gold", 2.0)]
    assert main(["keys", "set", hash_key(raw)[:8], "--tier", "-", "--weight", "0",
                 "--keys-file", str(keys_file)]) == EXIT_OK
    assert "default tier" in capsys.readouterr().out
    assert [(e.tier, e.weight) for e in read_entries(keys_file)] == [("", None)]
    assert read_keys_file(keys_file) == {hash_key(raw)}


def test_set_without_a_change_or_with_a_bad_weight_is_refused(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    keys_file = tmp_path / "keys"
    main(["keys", "add", "--label", "alice", "--keys-file", str(keys_file)])
    with pytest.raises(SystemExit) as exited:
        main(["keys", "set", "alice", "--keys-file", str(keys_file)])
    assert exited.value.code == EXIT_USAGE
    assert main(["keys", "set", "alice", "--weight", "-2", "--keys-file", str(keys_file)]) == EXIT_FAILED
    assert "Invalid weight" in capsys.readouterr().err


def test_a_tier_the_config_does_not_define_is_refused_when_the_config_is_known(
        tmp_path: Path, tiny_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["keys", "add", "--tier", "glod", "-c", str(tiny_config)])
    assert exited.value.code == EXIT_USAGE
    assert "did you mean 'gold'?" in capsys.readouterr().err
    assert main(["keys", "add", "--label", "alice", "--tier", "gold", "-c", str(tiny_config)]) == EXIT_OK
    with pytest.raises(SystemExit):
        main(["keys", "set", "alice", "--tier", "platinum", "-c", str(tiny_config)])
    assert [e.tier for e in read_entries(tmp_path / "from-config.keys")] == ["gold"]


@pytest.fixture
def tiny_config(tmp_path: Path) -> Path:
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump({
        "auth": {"keys_file": str(tmp_path / "from-config.keys")},
        "tenancy": {"tiers": {"default": {}, "gold": {"weight": 4}}},
        "applications": [{"name": "server", "route_prefix": "/api/v1", "import_path": "server", "args": {}}],
    }))
    return path
