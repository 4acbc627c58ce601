"""The ``aio`` config section and the handle settings: DeepSpeed's keys, defaults and errors."""

from __future__ import annotations

import pytest

from ds_offload_aio import AioConfig, AioHandle, ConfigError


def test_defaults_are_deepspeeds() -> None:
    assert AioConfig() == AioConfig(
        block_size=1048576,
        queue_depth=8,
        intra_op_parallelism=1,
        single_submit=False,
        overlap_events=True,
        use_gds=False,
    )
    assert AioConfig.from_dict(None) == AioConfig()


def test_from_dict_reads_the_json_section() -> None:
    section = {"block_size": 262144, "queue_depth": 32, "intra_op_parallelism": 4,
               "single_submit": True, "overlap_events": False}  # fmt: skip
    config = AioConfig.from_dict(section)
    assert config.handle_kwargs() == section
    with AioHandle.from_config(config) as handle:
        assert handle.get_block_size() == 262144 and handle.get_intra_op_parallelism() == 4


def test_thread_count_is_the_old_name_of_intra_op_parallelism() -> None:
    assert AioConfig.from_dict({"thread_count": 3}).intra_op_parallelism == 3
    assert (
        AioConfig.from_dict({"thread_count": 3, "intra_op_parallelism": 3}).intra_op_parallelism
        == 3
    )
    with pytest.raises(ConfigError, match="thread_count = 2 contradicts"):
        AioConfig.from_dict({"thread_count": 2, "intra_op_parallelism": 4})


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"queue_dept": 8}, "aio.queue_dept is not a known key; did you mean 'queue_depth'?"),
        ({"block_size": 1000}, "aio.block_size = 1000: must be a multiple of 4096"),
        ({"block_size": 0}, "aio.block_size = 0: expected a positive integer"),
        ({"queue_depth": 2.5}, "aio.queue_depth = 2.5: expected a positive integer"),
        ({"intra_op_parallelism": True}, "aio.intra_op_parallelism = True: expected a positive"),
        ({"single_submit": "false"}, "aio.single_submit = 'false': expected true or false"),
        ({"use_gds": 1}, "aio.use_gds = 1: expected true or false"),
    ],
)
def test_bad_values_name_key_value_and_fix(section: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        AioConfig.from_dict(section)
    assert str(info.value).startswith(message)


def test_handle_checks_its_settings_too() -> None:
    with pytest.raises(ConfigError, match=r"AioHandle.block_size = 5000: .* try 4096"):
        AioHandle(block_size=5000)
    with pytest.raises(ConfigError, match=r"AioHandle\.intra_op_parallelism = 0"):
        AioHandle(intra_op_parallelism=0)
    with pytest.raises(ValueError, match="backend = 'posix'"):
        AioHandle(backend="posix")  # type: ignore[arg-type]
