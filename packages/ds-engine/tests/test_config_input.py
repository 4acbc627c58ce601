"""Config files that are not what a config file should be: errors name the file and the problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from ds_comm import ConfigError


def test_a_binary_config_file_is_an_error_naming_the_file(tmp_path: Path) -> None:
    from ds_engine.api import load_config_dict

    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\x80\x02\xff\x00PK\x03\x04" * 8)
    with pytest.raises(ConfigError) as info:
        load_config_dict(binary)
    message = str(info.value)
    assert str(binary) in message and "not a UTF-8 text file" in message


def test_duplicate_keys_are_an_error_naming_the_key(tmp_path: Path) -> None:
    from ds_engine.api import load_config_dict

    for text in (
        '{"train_batch_size": 8, "train_batch_size": 16}',
        "{zero_optimization: {stage: 1, stage: 2}}",  # HJSON, nested
    ):
        path = tmp_path / "ds.json"
        path.write_text(text)
        with pytest.raises(
            ConfigError, match=r"Duplicate keys in DeepSpeed config: '(train_batch_size|stage)'"
        ):
            load_config_dict(path)
