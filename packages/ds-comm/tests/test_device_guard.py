"""Device guard mode: wrong-device tensors are refused by every op, before anything is issued.

On a CPU host the ``meta`` device stands in for "a device this group cannot use". Every rank
makes the same mistake, so all raise and nothing hangs; afterwards the same ranks run correct
collectives, which shows a refused call used no sequence number. A ``gpu`` test checks the NCCL
and gloo rules on a real GPU.
"""

from __future__ import annotations

import pytest
import torch

from ds_testing import run_on_ranks


def _refusals_body(rank: int, world_size: int) -> list[str]:
    import ds_comm

    n = world_size
    previous = ds_comm.device_guard(True)
    bad, good = torch.ones(4, device="meta"), torch.ones(4)
    calls = {
        "all_reduce": lambda: ds_comm.all_reduce(bad),
        "reduce": lambda: ds_comm.reduce(bad, 0),
        "broadcast": lambda: ds_comm.broadcast(bad, 0),
        "all_gather": lambda: ds_comm.all_gather([torch.ones(4) for _ in range(n)], bad),
        "all_gather_into_tensor": lambda: ds_comm.all_gather_into_tensor(
            torch.empty(4 * n, device="meta"), good
        ),
        "reduce_scatter_tensor": lambda: ds_comm.reduce_scatter_tensor(
            good, torch.empty(4 * n, device="meta")
        ),
        "reduce_scatter": lambda: ds_comm.reduce_scatter(bad, [good] * n),
        "all_to_all_single": lambda: ds_comm.all_to_all_single(bad, torch.ones(4 * n)[:4]),
        "all_to_all": lambda: ds_comm.all_to_all([good] * n, [bad] * n),
        "gather": lambda: ds_comm.gather(bad, [good] * n if rank == 0 else None, dst=0),
        "scatter": lambda: ds_comm.scatter(good, [bad] * n if rank == 0 else None, src=0),
        "all_reduce_coalesced": lambda: ds_comm.all_reduce_coalesced([good.clone(), bad]),
        "send": lambda: ds_comm.send(bad, (rank + 1) % n),
        "recv": lambda: ds_comm.recv(bad, (rank + 1) % n),
        "isend": lambda: ds_comm.isend(bad, (rank + 1) % n),
        "irecv": lambda: ds_comm.irecv(bad, (rank + 1) % n),
        "batch_isend_irecv": lambda: ds_comm.batch_isend_irecv(
            [ds_comm.P2POp(ds_comm.isend, bad, (rank + 1) % n)]
        ),
    }
    messages = []
    try:
        for name, call in calls.items():
            if name == "scatter" and rank != 0:
                continue  # only the root holds the wrong-device list
            try:
                call()
            except ds_comm.DeviceGuardError as exc:
                messages.append(f"{name}: {exc}")
            else:
                messages.append(f"{name}: NOT REFUSED")
        # the refused calls issued nothing and used no sequence number: correct ones still work
        t = torch.full((4,), float(rank))
        ds_comm.all_reduce(t)
        assert torch.equal(t, torch.full((4,), float(n * (n - 1) // 2)))
        seen = [None] * n
        ds_comm.all_gather_object(seen, rank)
        assert seen == list(range(n))
    finally:
        ds_comm.device_guard(previous)
    from ds_comm.accelerator import get_accelerator

    current = get_accelerator().current_device_name()
    expected = "cpu" if current == "cpu" else f"cpu or {current}"  # gloo takes both on a GPU host
    return [f"expected: {expected} for this gloo group", *messages]


def _env_body(rank: int, world_size: int) -> list[bool]:
    import ds_comm

    on = ds_comm.device_guard()  # None: only report
    try:
        ds_comm.all_reduce(torch.ones(1, device="meta"))
        refused = False
    except ds_comm.DeviceGuardError:
        refused = True
    ds_comm.all_reduce(torch.ones(1))
    return [on, refused]


def _off_body(rank: int, world_size: int) -> bool:
    import ds_comm

    return ds_comm.device_guard()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_wrong_device_tensors_are_refused_and_correct_ones_pass(world_size: int) -> None:
    for rank, (expected, *messages) in enumerate(run_on_ranks(_refusals_body, world_size)):
        expected = expected.removeprefix("expected: ")
        assert all("NOT REFUSED" not in m for m in messages), messages
        assert len(messages) == (17 if rank == 0 else 16)
        for message in messages:
            op, text = message.split(": ", 1)
            assert f"device guard: {op} on rank {rank} got a tensor on meta" in text, message
            assert f"expected {expected}" in text, message


def test_enabled_from_the_environment() -> None:
    results = run_on_ranks(_env_body, 2, fresh=True, env={"DS_DEVICE_GUARD": "1"})
    assert results == [[True, True]] * 2


def _group_device_body(rank: int, world_size: int) -> list[str]:
    import ds_comm

    sub = ds_comm.new_group(list(range(world_size)))
    return [str(ds_comm.group_device()), str(ds_comm.group_device(sub))]


def test_control_tensors_of_a_gloo_group_live_on_the_host() -> None:
    assert run_on_ranks(_group_device_body, 2) == [["cpu", "cpu"]] * 2


def test_off_when_the_environment_says_so() -> None:
    assert run_on_ranks(_off_body, 1, fresh=True, env={"DS_DEVICE_GUARD": "0"}) == [False]


def test_rank_workers_of_the_test_harness_run_guarded() -> None:
    # ds-testing turns the guard on in every rank worker, so the whole suite checks devices.
    assert run_on_ranks(_off_body, 2) == [True, True]


def test_bad_values_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    import ds_comm
    from ds_comm import _device_guard
    from ds_comm.api import ConfigError

    monkeypatch.setenv("DS_DEVICE_GUARD", "maybe")
    with pytest.raises(ConfigError, match="DS_DEVICE_GUARD='maybe': expected 1/true"):
        _device_guard._from_env()
    with pytest.raises(TypeError, match="expected True, False or None"):
        ds_comm.device_guard("yes")  # type: ignore[arg-type]
    assert ds_comm.device_guard() is False


def _gpu_body(rank: int, world_size: int) -> list[str]:
    import ds_comm
    from ds_comm.accelerator import get_accelerator

    acc = get_accelerator()
    device = acc.current_device_name()
    previous = ds_comm.device_guard(True)
    out = []
    try:
        t = torch.ones(4, device=device)
        ds_comm.all_reduce(t)  # NCCL default group, tensor on the current device: legal
        gloo = ds_comm.new_group(backend="gloo")
        ds_comm.all_reduce(t, group=gloo)  # gloo takes accelerator tensors too
        ds_comm.all_reduce(t.cpu(), group=gloo)  # and host tensors
        try:
            ds_comm.all_reduce(torch.ones(4))  # host tensor on NCCL
        except ds_comm.DeviceGuardError as exc:
            out.append(str(exc))
        try:
            ds_comm.all_reduce(torch.ones(4, device="meta"), group=gloo)
        except ds_comm.DeviceGuardError as exc:
            out.append(str(exc))
        # ds's own control tensors: on the device for NCCL, on the host for gloo
        out += [str(ds_comm.group_device()), str(ds_comm.group_device(gloo))]
    finally:
        ds_comm.device_guard(previous)
    return [device, *out]


@pytest.mark.gpu(1)
def test_rules_on_a_gpu() -> None:
    result = run_on_ranks(_gpu_body, 1, backend="nccl", fresh=True)[0]
    device, nccl_error, gloo_error, nccl_control, gloo_control = result
    assert device.startswith("cuda:")
    assert (nccl_control, gloo_control) == (device, "cpu")
    assert "got a tensor on cpu" in nccl_error and f"expected {device} for this nccl" in nccl_error
    assert f"expected cpu or {device} for this gloo group" in gloo_error
