"""The shared config-validation helpers every package's config section uses (pure logic)."""

from __future__ import annotations

import pytest

from ds_comm.api import ConfigError, as_section, check_keys, closest, is_auto, without_auto


def test_an_unknown_key_names_its_path_and_the_closest_known_key() -> None:
    with pytest.raises(ConfigError) as info:
        check_keys("aio", {"block_size": 1, "queue_dept": 8}, ["queue_depth", "block_size"])
    assert str(info.value) == "aio.queue_dept is not a known key; did you mean 'queue_depth'?"


def test_with_no_close_key_the_message_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        check_keys("", {"zzz": 1}, ["stage", "enabled"], what="a known config key")
    assert str(info.value) == "zzz is not a known config key; known keys: enabled, stage"


def test_always_list_names_a_close_key_and_every_accepted_one() -> None:
    with pytest.raises(ConfigError) as info:
        check_keys(
            "p", ["lrr"], ["lr", "eps"], what="a parameter", listing="accepted", always_list=True
        )
    assert str(info.value) == "p.lrr is not a parameter; did you mean 'lr'? accepted: eps, lr"


def test_known_keys_pass() -> None:
    assert check_keys("s", {"a": 1}, ["a", "b"]) is None


def test_sections_and_auto() -> None:
    assert as_section("s", None) == {}
    with pytest.raises(ConfigError, match=r"s = 3: expected a JSON object"):
        as_section("s", 3)
    assert is_auto("auto") and not is_auto("Auto") and not is_auto(None)
    assert without_auto({"a": "auto", "b": 1}) == {"b": 1}
    assert closest("stge", ["stage", "enabled"]) == "stage"
    assert closest("xyz", ["stage"]) is None
