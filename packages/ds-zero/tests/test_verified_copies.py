"""A masters-only load's shard files copied out while hashed ([Note: copying while verifying]):
``iter_fp32_tensors`` under a pending verification gives the tensors a plain read gives, from
the copies once the verdict is in (never before it), over ranges one piece holds and ranges
split across the ranks' files; the copies go with the check."""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ds_native
from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _ds_zero_testing import adam, global_batches, make_model, micro_batches

SHARD = "zero/zero_shards_rank00000.pt"


def _train_and_save(rank: int, world_size: int, *, path: str) -> None:
    from ds_zero import Stage3Optimizer, ZeroConfig, save_sharded_checkpoint

    model = make_model(torch.float32)
    section = {"stage": 3, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 64}
    zero = Stage3Optimizer(model, adam(list(model.parameters())), ZeroConfig.from_dict(section))
    for batch in global_batches(1, 8):
        (micro,) = micro_batches(batch, rank, world_size, 1)
        zero.backward(model(micro))
        zero.step()
    save_sharded_checkpoint(path, zero)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ZeRO-3 checkpoint of 2 ranks under ``zero/`` of a folder with its directory manifest."""
    from ds_zero._integrity import write_directory_manifest

    root = tmp_path_factory.mktemp("copies")
    run_on_ranks(_train_and_save, 2, path=str(root / "zero"), timeout=300)
    write_directory_manifest(root)
    return root


@pytest.fixture
def hashed_ahead(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """A core to spare and the files cached, forced; records each shard lookup's source."""
    from ds_zero import _integrity, _manifest

    monkeypatch.setattr(_integrity, "spare_core", lambda: True)
    monkeypatch.setattr(_integrity, "in_page_cache", lambda path, offsets: True)
    lookups: list[tuple[str, bool]] = []
    copy = _manifest.ShardReader._copy

    def recording(self, file, key):
        got = copy(self, file, key)
        lookups.append((file, got is not None))
        return got

    monkeypatch.setattr(_manifest.ShardReader, "_copy", recording)
    return lookups


@pytest.mark.skipif(not ds_native.native_available(), reason="no C extension: nothing copied")
def test_the_tensors_come_from_the_copies_after_the_verdict(
    checkpoint: Path, hashed_ahead: list[tuple[str, bool]]
) -> None:
    from ds_zero import iter_fp32_tensors, start_verification

    plain = dict(iter_fp32_tensors(checkpoint / "zero"))
    with start_verification(checkpoint, values=("param",)) as pending:
        tensors = iter_fp32_tensors(checkpoint / "zero", verified=pending)
        first = next(tensors)  # before the verdict: read from the file, no copy
        assert not any(copied for _, copied in hashed_ahead)
        assert pending.verified_copy(checkpoint / SHARD, "0/param") is None
        pending.wait()
        before = len(hashed_ahead)
        got = dict([first, *tensors])
        after = hashed_ahead[before:]  # one process checks both ranks' files: all copied
        assert {f for f, _ in after} == {Path(SHARD).name, "zero_shards_rank00001.pt"}
        assert all(copied for _, copied in after)
        assert pending.verified_copy(checkpoint / SHARD, "nothing/param") is None
    assert got.keys() == plain.keys()
    assert all(torch.equal(got[n], plain[n]) for n in plain)
    assert pending.verified_copy(checkpoint / SHARD, "0/param") is None  # closed: let go


@pytest.mark.skipif(not ds_native.native_available(), reason="no C extension: nothing copied")
def test_a_shard_file_on_the_disk_is_copied_once_the_loader_has_mapped_it(
    checkpoint: Path, hashed_ahead: list[tuple[str, bool]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """From a cold disk a masters-only load's shard files are not hashed ahead; once the loader
    has mapped each (its index read) the threads copy the masters out as they hash them, and
    after the verdict every tensor comes from those copies (see [Note: hashing ahead of the
    loader])."""
    from ds_zero import _integrity, iter_fp32_tensors, start_verification

    monkeypatch.setattr(_integrity, "in_page_cache", lambda path, offsets: False)
    plain = dict(iter_fp32_tensors(checkpoint / "zero"))
    with start_verification(checkpoint, values=("param",)) as pending:
        assert not pending.copying(checkpoint / SHARD)  # left to the loader
        tensors = iter_fp32_tensors(checkpoint / "zero", verified=pending)
        assert pending.copying(checkpoint / SHARD)  # mapped by the loader: copied as hashed
        pending.wait()
        before = len(hashed_ahead)
        got = dict(tensors)
        assert hashed_ahead[before:] and all(copied for _, copied in hashed_ahead[before:])
    assert got.keys() == plain.keys()
    assert all(torch.equal(got[n], plain[n]) for n in plain)


@pytest.mark.skipif(not ds_native.native_available(), reason="no C extension: nothing copied")
def test_a_range_one_piece_holds_is_a_view_of_the_copy(
    checkpoint: Path, hashed_ahead: list[tuple[str, bool]]
) -> None:
    from ds_zero import start_verification
    from ds_zero._manifest import ShardReader, read_manifest

    source = checkpoint / "zero"
    manifest = read_manifest(source)
    with start_verification(checkpoint, values=("param",)) as pending:
        reader = ShardReader(source, manifest, copied=pending.verified_copy)
        reader.open(("param",))
        pending.wait()
        name, entry = next(
            (n, e)
            for n, e in manifest["tensors"].items()
            if any(f == Path(SHARD).name and b - a > 2 for f, _, a, b in e["pieces"])
        )
        file, key, start, stop = next(p for p in entry["pieces"] if p[0] == Path(SHARD).name)
        copy = pending.verified_copy(checkpoint / "zero" / file, f"{key}/param")
        assert copy is not None
        part = reader.lookup(name, start + 1, stop - 1, ("param",))["param"]
        assert part.data_ptr() == copy.view(-1)[1:].data_ptr()  # no second copy
        assert torch.equal(
            part, ShardReader(source, manifest).lookup(name, start + 1, stop - 1)["param"]
        )


def _model_file(folder: Path) -> Path:
    """A model states file of 8 MiB (too big to hash on the loading thread) with a tensor the
    manifest cannot list (no bytes), a strided one, one inside a list, and counters; its
    directory manifest written."""
    from ds_zero._integrity import write_directory_manifest

    path = folder / "mp_rank_00_model_states.pt"
    module = {"w": torch.randn(1 << 21), "b": torch.randn(8), "empty": torch.empty(0)}
    module["t"] = torch.randn(16, 24).t()  # strided: its entry holds the whole storage
    torch.save({"module": module, "steps": 7, "extra": [torch.arange(4)]}, path)
    write_directory_manifest(folder)
    return path


@pytest.mark.skipif(not ds_native.native_available(), reason="no C extension: nothing copied")
def test_the_file_the_loader_reads_whole_is_copied_and_its_tensors_swapped_for_the_copies(
    tmp_path: Path, hashed_ahead: list[tuple[str, bool]]
) -> None:
    """The model file, named in ``loaded``: copied while hashed, so the loader maps it for its
    structure alone and, after the verdict, gets every tensor from the copies (those the
    manifest cannot list cloned, a strided one viewing its storage's copy), never a view of
    the file."""
    from ds_zero import start_verification

    path = _model_file(tmp_path)
    plain = torch.load(path, weights_only=True)
    with start_verification(tmp_path, values=("param",), loaded=(path.name,)) as pending:
        assert pending.copying(path)
        mapped = torch.load(path, weights_only=True, mmap=True)
        with pytest.raises(RuntimeError, match="before the verdict"):
            pending.verified_object(path, mapped)
        pending.wait()
        assert not pending.copying(path)  # decided: nothing more is copied
        got = pending.verified_object(path, mapped)
        copy = pending.verified_copy(path, "module/w")
        assert copy is not None and got["module"]["w"].data_ptr() == copy.data_ptr()
        assert got["extra"][0].data_ptr() == pending.verified_copy(path, "extra[0]").data_ptr()
        strided = pending.verified_copy(path, "module/t")
        assert strided is not None
        assert got["module"]["t"].data_ptr() == strided.data_ptr()
    file_bytes = mapped["module"]["w"].untyped_storage()
    assert file_bytes.data_ptr() != got["module"]["w"].untyped_storage().data_ptr()
    assert got["steps"] == 7 and got.keys() == plain.keys()
    assert got["module"]["t"].stride() == plain["module"]["t"].stride()
    for name in ("w", "b", "empty", "t"):
        assert torch.equal(got["module"][name], plain["module"][name])
    assert torch.equal(got["extra"][0], plain["extra"][0])


@pytest.mark.skipif(not ds_native.native_available(), reason="no C extension: nothing copied")
def test_a_tensor_read_as_other_than_its_manifest_says_is_refused_not_cloned(
    tmp_path: Path, hashed_ahead: list[tuple[str, bool]]
) -> None:
    """A loaded tensor whose shape is not its manifest entry's (the copy would be read as
    something else): an error naming the file and the tensor, not a clone of the mapping."""
    from ds_zero import CheckpointError, start_verification

    path = _model_file(tmp_path)
    with start_verification(tmp_path, values=("param",), loaded=(path.name,)) as pending:
        mapped = torch.load(path, weights_only=True, mmap=True)
        pending.wait()
        mapped["module"]["w"] = mapped["module"]["w"].view(2, -1)
        with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states.pt: tensor 'module/w'"):
            pending.verified_object(path, mapped)


@pytest.mark.skipif(not ds_native.native_available(), reason="no C extension: nothing copied")
def test_a_model_file_tensor_changed_before_it_is_copied_is_refused(
    tmp_path: Path, hashed_ahead: list[tuple[str, bool]]
) -> None:
    from ds_zero import CheckpointError, start_verification

    path = _model_file(tmp_path)
    data = bytearray(path.read_bytes())
    entries = json.loads((tmp_path / "ds_manifest.json").read_text())["files"][path.name]
    data[int(entries["tensors"]["module/w"]["offset"]) + 5] ^= 0x10
    path.write_bytes(bytes(data))
    with start_verification(tmp_path, values=("param",), loaded=(path.name,)) as pending:
        assert pending.copying(path)
        with pytest.raises(
            CheckpointError, match=r"mp_rank_00_model_states.pt corrupted.*module/w"
        ):
            pending.wait()


@pytest.mark.skipif(not ds_native.native_available(), reason="no C extension: nothing copied")
@pytest.mark.parametrize("damaged", [False, True], ids=["intact", "damaged"])
def test_a_model_file_on_the_disk_is_copied_as_it_is_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damaged: bool
) -> None:
    """Not in the page cache, the model file is copied as it is hashed too, so the disk is read
    once, by the checksum threads, and the loader maps the file for its structure alone (see
    [Note: copying the file the loader reads whole]): the values are the plain read's, taken
    from the copies; a flipped byte in a tensor is refused, naming it."""
    from ds_zero import CheckpointError, _integrity, start_verification

    monkeypatch.setattr(_integrity, "spare_core", lambda: True)
    monkeypatch.setattr(_integrity, "in_page_cache", lambda path, offsets: False)
    path = _model_file(tmp_path)
    plain = torch.load(path, weights_only=True)
    if damaged:
        entries = json.loads((tmp_path / "ds_manifest.json").read_text())["files"][path.name]
        data = bytearray(path.read_bytes())
        data[int(entries["tensors"]["module/b"]["offset"]) + 2] ^= 0x10
        path.write_bytes(bytes(data))
    with start_verification(tmp_path, values=("param",), loaded=(path.name,)) as pending:
        assert pending.copying(path)
        mapped = torch.load(path, weights_only=True, mmap=True)
        if damaged:
            with pytest.raises(CheckpointError, match=r"model_states.pt corrupted.*module/b"):
                pending.wait()
            return
        pending.wait()
        got = pending.verified_object(path, mapped)
        copy = pending.verified_copy(path, "module/w")
        assert copy is not None and got["module"]["w"].data_ptr() == copy.data_ptr()
    for name in ("w", "b", "empty", "t"):
        assert torch.equal(got["module"][name], plain["module"][name])


def test_a_file_hashed_from_the_loaders_read_is_not_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No core to spare: the model file is hashed from what the loader read (one pass on its
    core), nothing is copied, and the loader's own tensors are the ones used."""
    from ds_zero import _integrity, start_verification

    monkeypatch.setattr(_integrity, "spare_core", lambda: False)
    path = _model_file(tmp_path)
    with start_verification(tmp_path, values=("param",), loaded=(path.name,)) as pending:
        assert not pending.copying(path)
        state = torch.load(path, weights_only=True)
        pending.hash_loaded(path, state)
        pending.wait()
        assert pending.verified_object(path, state) is state
        assert pending.verified_copy(path, "module/w") is None


@pytest.mark.parametrize("spare", [True, False], ids=["copied-while-hashed", "loaders-read"])
def test_tensors_named_unused_are_neither_checked_nor_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spare: bool
) -> None:
    """``unused``: a load that does not use a tensor neither hashes nor copies it, so a flipped
    byte there is not its error, while the same flip in a tensor it uses is; the tensor must be
    dropped from what was read before ``verified_object``, which refuses to pass it on."""
    from ds_zero import CheckpointError, _integrity, start_verification

    monkeypatch.setattr(_integrity, "spare_core", lambda: spare)
    monkeypatch.setattr(_integrity, "in_page_cache", lambda path, offsets: True)
    path = _model_file(tmp_path)
    plain = torch.load(path, weights_only=True)
    entries = json.loads((tmp_path / "ds_manifest.json").read_text())["files"][path.name]
    data = bytearray(path.read_bytes())
    data[int(entries["tensors"]["module/w"]["offset"]) + 5] ^= 0x10
    path.write_bytes(bytes(data))

    def load(unused: list[str]) -> dict:
        with start_verification(tmp_path, loaded=(path.name,), unused={path.name: unused}) as p:
            state = torch.load(path, weights_only=True, mmap=p.copying(path))
            p.hash_loaded(path, state)
            p.wait()
            with pytest.raises(RuntimeError, match=r"\['module/w'\] were left unchecked"):
                p.verified_object(path, state)
            del state["module"]["w"]
            got = p.verified_object(path, state)
            if spare and ds_native.native_available():  # copied while hashed, w excepted
                assert p.verified_copy(path, "module/b") is not None
                assert p.verified_copy(path, "module/w") is None
            return got

    got = load(["module/w"])
    assert torch.equal(got["module"]["b"], plain["module"]["b"]) and got["steps"] == 7
    with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states.pt corrupted.*module/w"):
        load(["module/b"])


def test_map_tensors_names_tensors_as_walk_does_and_rebuilds_only_what_holds_one() -> None:
    from collections import OrderedDict

    from ds_zero._read_checks import map_tensors, walk

    state: OrderedDict[str, Any] = OrderedDict(w=torch.ones(2), n=3)
    state._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]  # as a state dict's
    obj = {"module": state, "lists": [torch.zeros(1), (torch.ones(1), 2)], "plain": {"k": [1]}}
    found: list[tuple[str, torch.Tensor]] = []
    walk(obj, "", found)
    seen: list[str] = []

    def doubled(name: str, t: torch.Tensor) -> torch.Tensor:
        seen.append(name)
        return t * 2

    got = map_tensors(obj, doubled)
    assert seen == [n for n, _ in found] == ["module/w", "lists[0]", "lists[1][0]"]
    assert type(got["module"]) is OrderedDict and got["module"]._metadata == state._metadata
    assert torch.equal(got["module"]["w"], torch.full((2,), 2.0)) and got["module"]["n"] == 3
    assert isinstance(got["lists"][1], tuple) and got["lists"][1][1] == 2
    assert got["plain"] is obj["plain"]  # nothing in it to replace
    assert torch.equal(obj["module"]["w"], torch.ones(2))  # the original is left as it was
    assert map_tensors(obj, lambda name, t: t) is obj


def _mapping_of(address: int) -> list[str] | None:
    """The ``/proc/self/smaps`` lines of the mapping holding ``address`` (None: unmapped)."""
    found: list[str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            if found is not None:
                return found
            low, high = (int(x, 16) for x in head.groups())
            found = [line] if low <= address < high else None
        elif found is not None:
            found.append(line)
    return found


needs_huge_pages = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="transparent huge pages: Linux"
)


def _huge_pages_or_skip() -> None:
    from ds_zero._verified_copies import huge_pages_offered

    if not huge_pages_offered():
        pytest.skip("this kernel offers no transparent huge pages")


def _copies(nbytes: int) -> Any:
    """The copies of one file holding one uint8 tensor ``"t"`` of ``nbytes``."""
    from ds_zero._verified_copies import CopiedTensors

    entries = {"t": {"dtype": "torch.uint8", "shape": [nbytes], "nbytes": nbytes}}
    return CopiedTensors.of(entries, ["t"])


def _lazy_free_kib(smaps: list[str]) -> int:
    return int(next(line for line in smaps if line.startswith("LazyFree:")).split()[1])


@pytest.fixture
def no_kept_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start the test with no copy buffer kept (an earlier test's would be reused)."""
    from ds_zero import _verified_copies

    monkeypatch.setattr(_verified_copies, "_kept", [])


@needs_huge_pages
def test_copies_of_2_mib_or_more_are_in_memory_advised_huge_pages(no_kept_buffers: None) -> None:
    """Where the kernel offers transparent huge pages, a copy buffer of 2 MiB or more is an
    anonymous mapping of its own, 2 MiB-aligned and eligible for them (a few faults of 2 MiB
    instead of thousands of 4 KiB), returned to the system once no tensor views it."""
    import gc

    from ds_zero._verified_copies import copy_buffer

    _huge_pages_or_skip()
    memory, region = copy_buffer(3 << 20)
    assert region is not None
    address = memory.data_ptr()
    assert memory.numel() == 3 << 20 and address % (2 << 20) == 0
    assert memory.untyped_storage().nbytes() == (3 << 20) + (2 << 20)  # the mapping's own
    smaps = _mapping_of(address)
    assert smaps is not None
    assert any(re.fullmatch(r"THPeligible:\s+1", line) for line in smaps)
    flags = next(line for line in smaps if line.startswith("VmFlags:")).split()
    assert "hg" in flags  # advised MADV_HUGEPAGE
    memory.fill_(7)  # written through
    assert int(memory[-1]) == 7
    del memory, region  # never kept
    gc.collect()
    assert _mapping_of(address) is None


@needs_huge_pages
def test_a_released_buffer_is_kept_lazily_freed_and_lent_to_the_next_load(
    no_kept_buffers: None,
) -> None:
    """Released, a file's copy buffer stays mapped, advised ``MADV_FREE`` (the kernel may take
    its pages back, else the next load writes them without a fault), and the next file of its
    size or smaller is copied into it."""
    _huge_pages_or_skip()
    first = _copies(4 << 20)
    t = first.tensor("t")
    assert t is not None
    t.fill_(1)
    address = t.data_ptr()
    del t
    first.release()
    assert first.tensor("t") is None
    smaps = _mapping_of(address)
    assert smaps is not None and _lazy_free_kib(smaps) > 0
    second = _copies(3 << 20)
    t = second.tensor("t")
    assert t is not None and t.data_ptr() == address
    t.fill_(2)
    assert _lazy_free_kib(_mapping_of(address) or []) == 0  # written: the pages are kept
    del t
    second.release()
    bigger = _copies(5 << 20).tensor("t")  # more than it holds: a new buffer
    assert bigger is not None and bigger.data_ptr() != address


@needs_huge_pages
def test_a_buffer_still_viewed_is_not_kept_and_its_values_stay(no_kept_buffers: None) -> None:
    """A copy the caller still holds (``iter_fp32_tensors`` hands its tensors out) keeps its
    buffer out of the kept ones: a later load copies elsewhere and leaves its values."""
    from ds_zero import _verified_copies

    _huge_pages_or_skip()
    first = _copies(4 << 20)
    held = first.tensor("t")
    assert held is not None
    held.fill_(1)
    first.release()
    assert _verified_copies._kept == []
    later = _copies(4 << 20).tensor("t")
    assert later is not None and later.data_ptr() != held.data_ptr()
    later.fill_(2)
    assert bool((held == 1).all())


@needs_huge_pages
def test_buffers_kept_beyond_the_budget_are_unmapped_largest_first(
    no_kept_buffers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ds_zero import _verified_copies

    _huge_pages_or_skip()
    monkeypatch.setattr(_verified_copies, "_KEEP_BYTES", 7 << 20)
    files = [_copies(n << 20) for n in (2, 4, 3)]  # all alive at once: three buffers
    addresses = []
    for copies in files:
        t = copies.tensor("t")
        assert t is not None
        addresses.append(t.data_ptr())
        del t
    for copies in files:
        copies.release()
    assert sorted(r.capacity for r in _verified_copies._kept) == [2 << 20, 3 << 20]
    assert _mapping_of(addresses[1]) is None  # the 4 MiB one
    assert _mapping_of(addresses[0]) is not None and _mapping_of(addresses[2]) is not None


@needs_huge_pages
def test_a_forked_child_keeps_none_of_its_parents_buffers(no_kept_buffers: None) -> None:
    """A child forked after a load starts with no kept buffer (its copies of the parent's
    mappings are not lent) and a lock of its own."""
    from ds_zero import _verified_copies

    _huge_pages_or_skip()
    _copies(4 << 20).release()
    assert len(_verified_copies._kept) == 1
    child = os.fork()
    if child == 0:  # pragma: no cover (the child's verdict is its exit status)
        ok = _verified_copies._kept == [] and not _verified_copies._kept_lock.locked()
        os._exit(0 if ok else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(_verified_copies._kept) == 1  # the parent's own stays


def test_small_copies_and_kernels_without_huge_pages_use_torch_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ds_zero import _verified_copies

    small, region = _verified_copies.copy_buffer((2 << 20) - 1)
    assert region is None
    assert small.untyped_storage().nbytes() == (2 << 20) - 1  # torch.empty's, exactly
    monkeypatch.setattr(_verified_copies, "huge_pages_offered", lambda: False)
    big, region = _verified_copies.copy_buffer(4 << 20)
    assert region is None and big.untyped_storage().nbytes() == 4 << 20


def test_copies_are_carved_apart_aligned_and_shaped_as_recorded() -> None:
    """Each tensor of a file gets its own bytes of the one buffer: 64-byte aligned, its
    recorded dtype and shape, no two overlapping (so writing one leaves the others)."""
    from ds_zero._verified_copies import CopiedTensors

    entries = {
        "a": {"dtype": "torch.float32", "shape": [1024, 1024], "nbytes": 4 << 20},
        "b": {"dtype": "torch.bfloat16", "shape": [3], "nbytes": 6},
        "c": {"dtype": "torch.float64", "shape": [5, 2], "nbytes": 80},
    }
    order = ["b", "a", "c"]
    copies = CopiedTensors.of(entries, order)
    assert copies is not None
    tensors = {n: copies.tensor(n) for n in order}
    spans = []
    for name, t in tensors.items():
        assert t is not None and t.data_ptr() % 64 == 0
        assert str(t.dtype) == entries[name]["dtype"]
        assert list(t.shape) == entries[name]["shape"] and t.is_contiguous()
        spans.append((t.data_ptr(), t.data_ptr() + entries[name]["nbytes"]))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    for value, t in enumerate(tensors.values()):
        assert t is not None
        t.fill_(value)
    assert [float(t.flatten()[-1]) for t in tensors.values() if t is not None] == [0, 1, 2]
    assert copies.nbytes == (4 << 20) + 86


@needs_huge_pages
def test_copies_are_written_at_offsets_of_one_buffer_and_made_tensors_after(
    no_kept_buffers: None,
) -> None:
    """A copying job gets the one buffer and each tensor's byte offset in it (no tensor per
    copy before the verdict); the tensors made after it read what was written there, in every
    dtype, and once they are gone the buffer is kept for the next load."""
    from ds_zero import _verified_copies
    from ds_zero._verified_copies import CopiedTensors

    _huge_pages_or_skip()
    values = {
        "w": torch.arange(1 << 20, dtype=torch.float32).view(1024, 1024),
        "h": torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16),
        "n": torch.arange(10, dtype=torch.int64).view(2, 5),
    }
    entries = {
        n: {"dtype": str(t.dtype), "shape": list(t.shape), "nbytes": t.numel() * t.itemsize}
        for n, t in values.items()
    }
    copies = CopiedTensors.of(entries, list(values))
    assert copies is not None
    ((first, indices, places),) = copies.next_run([(0, int(entries["w"]["nbytes"]))])
    ((rest, more_indices, more),) = copies.next_run([(0, 1), (0, 1)])
    assert rest is first and places == [0] and more == [4 << 20, (4 << 20) + 64]
    assert indices == [0] and more_indices == [0, 1]
    for place, t in zip(places + more, values.values()):  # what the copying kernel writes
        raw = t.contiguous().view(torch.uint8).flatten()
        first[place : place + raw.numel()].copy_(raw)
    del first, rest
    for name, t in values.items():
        copy = copies.tensor(name)
        assert copy is not None and copy.dtype == t.dtype and torch.equal(copy, t)
        assert copy.is_contiguous() and copy.data_ptr() % 64 == 0
    transposed = copies.view_as("n", [5, 2], [1, 5], 0)  # a loaded view of the same bytes
    assert torch.equal(transposed, values["n"].t())
    del copy, transposed
    copies.release()
    assert len(_verified_copies._kept) == 1
    assert copies.tensor("w") is None and copies.spot("w") is None


def test_tensors_named_into_are_copied_into_that_memory_and_read_from_it() -> None:
    """``into``: the tensors named are copied into the caller's memory (one destination for
    views of one storage, each at its own byte offset), the others into the buffer; the
    tensors made after the verdict view that memory."""
    from ds_zero._verified_copies import CopiedTensors

    values = {
        "a": torch.arange(6, dtype=torch.float32).view(2, 3),
        "buffer": torch.tensor([7, 8], dtype=torch.int64),
        "b": torch.arange(4, dtype=torch.float32) - 9,
    }
    entries = {
        n: {"dtype": str(t.dtype), "shape": list(t.shape), "nbytes": t.numel() * t.itemsize}
        for n, t in values.items()
    }
    master = torch.zeros(16, dtype=torch.float32)
    into = {"a": master.narrow(0, 2, 6).view(2, 3), "b": master.narrow(0, 10, 4)}
    copies = CopiedTensors.of(entries, list(values), into=into)
    assert copies is not None and copies.into and copies.nbytes == 16  # the buffer: one tensor
    runs = copies.next_run([(0, 1), (0, 1), (0, 1)])
    assert len(runs) == 2
    (target, target_indices, target_at), (buffer, buffer_indices, buffer_at) = sorted(
        runs, key=lambda run: run[1][0]
    )
    assert buffer_indices == [1] and buffer_at == [0]
    assert target_indices == [0, 2] and target_at == [8, 40]
    assert target.data_ptr() == master.data_ptr() and target.numel() == 64
    for index, place in zip(buffer_indices + target_indices, buffer_at + target_at):
        out = buffer if index == 1 else target
        raw = list(values.values())[index].contiguous().view(torch.uint8).flatten()
        out[place : place + raw.numel()].copy_(raw)  # what the copying kernel writes
    assert torch.equal(master[2:8], values["a"].flatten()) and torch.equal(
        master[10:14], values["b"]
    )
    for name, t in values.items():
        copy = copies.tensor(name)
        assert copy is not None and torch.equal(copy, t)
    a = copies.tensor("a")
    assert a is not None and a.data_ptr() == master[2:].data_ptr()
    copies.release()


@pytest.mark.parametrize(
    "target",
    [
        torch.zeros(6, dtype=torch.float64),  # another dtype
        torch.zeros(5, dtype=torch.float32),  # another size
        torch.zeros(12, dtype=torch.float32)[::2],  # not contiguous
    ],
)
def test_into_is_all_or_nothing(target: torch.Tensor) -> None:
    """One named tensor that cannot take its bytes: none is copied into the caller's memory
    (a caller that restores them on a failed load treats them alike)."""
    from ds_zero._verified_copies import CopiedTensors

    entries = {n: {"dtype": "torch.float32", "shape": [6], "nbytes": 24} for n in ("good", "bad")}
    fits = torch.zeros(6, dtype=torch.float32)
    copies = CopiedTensors.of(entries, ["good", "bad"], into={"good": fits, "bad": target})
    assert copies is not None and not copies.into and copies.nbytes == 48
    missing = CopiedTensors.of(entries, ["good"], into={"good": fits, "bad": fits.clone()})
    assert missing is not None and not missing.into


def test_copies_are_refused_for_an_entry_whose_shape_and_dtype_miss_its_bytes() -> None:
    from ds_zero._verified_copies import CopiedTensors

    good = {"dtype": "torch.float32", "shape": [4], "nbytes": 16}
    assert CopiedTensors.of({"a": good}, ["a"]) is not None
    assert CopiedTensors.of({"a": {**good, "nbytes": 12}}, ["a"]) is None
    assert CopiedTensors.of({"a": {**good, "dtype": "torch.nonsense"}}, ["a"]) is None
    assert CopiedTensors.of({"a": good}, []) is None
