"""Resource selection as DeepSpeed documents it (--include/--exclude, --num_nodes/--num_gpus), the
local pool (visible GPUs, or CPU ranks), and option validation."""

from __future__ import annotations

import pytest

from ds_launch import LaunchConfig, LaunchError, plan_launch, select_resources
from ds_launch._devices import parse_core_list, rank_core_shares, visible_gpu_ids

POOL = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3], "worker-2": [0, 1, 2, 3]}


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, POOL),
        # DeepSpeed's examples: all slots of worker-0, slots 0 and 2 of worker-1.
        ({"include": "worker-0@worker-1:0,2"}, {"worker-0": [0, 1, 2, 3], "worker-1": [0, 2]}),
        (
            {"exclude": "worker-1:0"},
            {"worker-0": [0, 1, 2, 3], "worker-1": [1, 2, 3], "worker-2": [0, 1, 2, 3]},
        ),
        ({"exclude": "worker-2:0@worker-0"}, {"worker-1": [0, 1, 2, 3], "worker-2": [1, 2, 3]}),
        # Included hosts keep the pool's order; slots keep the order written (GPU 3 first).
        ({"include": "worker-2@worker-0:3,1,3"}, {"worker-0": [3, 1], "worker-2": [0, 1, 2, 3]}),
        ({"num_nodes": 2}, {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}),
        ({"num_gpus": 2}, {"worker-0": [0, 1], "worker-1": [0, 1], "worker-2": [0, 1]}),
        ({"num_nodes": 1, "num_gpus": 3}, {"worker-0": [0, 1, 2]}),
    ],
    ids=["all", "include", "exclude-slot", "exclude-host", "order", "nodes", "gpus", "both"],
)
def test_selection(kwargs, expected):
    assert select_resources(POOL, **kwargs) == expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"include": "worker-9"}, "host 'worker-9' is not in the hostfile (hosts: worker-0, "),
        ({"exclude": "worker-1:4"}, "slot(s) 4 not on host 'worker-1'"),
        ({"include": "worker-1:0,x"}, "slot 'x' of 'worker-1' is not a number"),
        ({"include": "worker-1:0@worker-1:1"}, "host 'worker-1' appears twice"),
        ({"include": "@worker-1"}, "empty host name"),
        ({"exclude": "worker-0@worker-1@worker-2"}, "leaves no slot"),
        ({"include": "worker-0", "exclude": "worker-1"}, "mutually exclusive"),
        ({"num_nodes": 4}, "--num_nodes 4, but the hostfile has 3 host(s)"),
        ({"num_gpus": 5}, "--num_gpus 5, but in the hostfile worker-0 has 4"),
    ],
)
def test_selection_errors_name_what_is_wrong(kwargs, message):
    with pytest.raises(LaunchError) as info:
        select_resources(POOL, **kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"include": "a", "exclude": "b"}, "mutually exclusive"),
        ({"include": "a", "num_gpus": 2}, "cannot be combined with --num_nodes/--num_gpus"),
        ({"exclude": "a", "num_nodes": 1}, "cannot be combined"),
        ({"num_gpus": 0}, "--num_gpus 0: must be >= 1"),
        ({"launcher": "torchrun"}, "--launcher torchrun: unknown launcher; use one of local, "),
        ({"module": True, "no_python": True}, "pick one"),
        ({"master_port": 70000}, "--master_port 70000: not a TCP port"),
        ({"ssh_port": 0}, "--ssh_port 0: not a TCP port"),
        ({"bind_core_list": "0-3"}, "only used with --bind_cores_to_rank"),
        ({"bind_cores_to_rank": True, "bind_core_list": "3-1"}, "descending core range '3-1'"),
        ({"kill_grace": -1.0}, "--kill_grace -1.0: must be >= 0"),
        ({"user_script": ""}, "no user script"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(LaunchError) as info:
        LaunchConfig(**{"user_script": "train.py", **kwargs})
    assert message in str(info.value)


def test_launcher_name_is_case_insensitive():
    assert LaunchConfig(user_script="t.py", launcher="OpenMPI").launcher == "openmpi"


def test_visible_gpu_ids_from_env_or_device_nodes(tmp_path):
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": "3,1"}) == [3, 1]
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": "0,-1,2"}) == [0]  # CUDA stops at -1
    with pytest.raises(ValueError, match="'GPU-8e1f' is not an integer id"):
        visible_gpu_ids({"CUDA_VISIBLE_DEVICES": "GPU-8e1f"})
    for name in ("nvidia1", "nvidia0", "nvidiactl", "nvidia-uvm", "null"):
        (tmp_path / name).touch()
    assert visible_gpu_ids({}, dev_dir=str(tmp_path)) == [0, 1]
    assert visible_gpu_ids({}, dev_dir=str(tmp_path / "missing")) == []


def test_rocm_gpus_are_the_kfd_nodes_with_compute_units(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "kfd").touch()
    nodes = tmp_path / "nodes"
    for node, simd_count in (("0", 0), ("1", 304), ("2", 304)):  # node 0 is the CPU
        (nodes / node).mkdir(parents=True)
        (nodes / node / "properties").write_text(f"cpu_cores_count 0\nsimd_count {simd_count}\n")
    assert visible_gpu_ids({}, dev_dir=str(dev), kfd_nodes=str(nodes)) == [0, 1]


def test_local_pool_honours_cuda_visible_devices(tmp_path):
    environ = {"CUDA_VISIBLE_DEVICES": "2,3,5"}

    def slots(**kwargs):
        config = LaunchConfig(user_script="t.py", hostfile=None, **kwargs)
        plan = plan_launch(config, environ, cwd=str(tmp_path))
        assert plan.launcher == "local"
        return [list(n.slots) for n in plan.nodes]

    assert slots() == [[2, 3, 5]]
    assert slots(num_gpus=2) == [[2, 3]]
    assert slots(include="localhost:5") == [[5]]
    assert slots(exclude="localhost:3") == [[2, 5]]
    with pytest.raises(LaunchError, match=r"not on host 'localhost' in this machine"):
        slots(include="localhost:0")
    with pytest.raises(LaunchError, match="--num_nodes 2, but this machine"):
        slots(num_nodes=2)


def test_without_gpus_num_gpus_is_the_number_of_cpu_ranks(tmp_path):
    config = LaunchConfig(user_script="t.py", num_gpus=3)
    plan = plan_launch(config, {"CUDA_VISIBLE_DEVICES": ""}, cwd=str(tmp_path))
    assert plan.world_size == 3
    assert [r.rank for r in plan.nodes[0].ranks] == [0, 1, 2]
    assert "--cpu" in plan.nodes[0].command  # the agent leaves CUDA_VISIBLE_DEVICES alone


def test_core_lists_and_shares():
    assert parse_core_list("1,3-5,7,4") == [1, 3, 4, 5, 7]
    assert rank_core_shares(list(range(10)), 3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(ValueError, match="bad core range 'a'"):
        parse_core_list("0,a")
    with pytest.raises(ValueError, match="cannot be shared by 4 ranks"):
        rank_core_shares([0, 1], 4)
