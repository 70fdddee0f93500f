"""sluice's Python API follows PyTorch's conventions (issue 38, item 4): dtypes as torch.dtype
or a name, devices as torch.device, a name or an index, sizes as an int of bytes or a size
string, the current accelerator as the default device (python/sluice/_devices.py, Note
[default device]), sluice.InvalidArgument a ValueError too, and the offload handle a
context manager. On the CPU device (plain, and strict with SLUICE_STRICT_DEVICE=1) and on
the torch test accelerator (SLUICE_TEST_DEVICE=testaccel), where the current accelerator
is that PrivateUse1 device once its library is loaded, so the default device becomes it."""
import logging

import pytest
import torch

import sluice
from sluice import _devices
from offload_helpers import DEVICE, assert_restored, backend, offload, on_device, snapshot

torch.set_num_threads(1)


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj_in = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.proj_out = torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.proj_out(torch.nn.functional.gelu(self.norm(self.proj_in(x))))


def toy():
    torch.manual_seed(0)
    return Toy().to(torch.bfloat16)


def x_in():
    return torch.randn(2, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


def available_accelerator():
    """The accelerator torch itself reports available, read without sluice."""
    acc = torch.accelerator.current_accelerator(check_available=True)
    return None if acc is None else acc.type


# --- dtypes ----------------------------------------------------------------------------------

def test_storage_and_compute_take_a_torch_dtype_or_its_name():
    m = toy()
    want = m(x_in())
    with offload(m, storage=torch.bfloat16, compute=torch.bfloat16) as h:
        assert h.stats()["model"]["storage_dtype"] == "bfloat16"
        with torch.no_grad():
            assert torch.equal(m(on_device(x_in())).cpu(), want)
    with offload(m, storage="torch.float8_e4m3fn", compute="float32") as h:  # str(torch.float8_e4m3fn) too
        assert h.stats()["model"]["storage_dtype"] == "float8_e4m3fn"
    for bad in (16, None, 1.0):
        with pytest.raises(sluice.InvalidArgument, match=r"offload: storage= takes a torch.dtype"):
            offload(m, storage=bad)
    with pytest.raises(ValueError, match=r"offload: compute= takes a torch.dtype or its name, got int"):
        offload(m, compute=32)
    assert "forward" not in m.__dict__


def test_model_cache_load_and_inspect_take_a_torch_dtype():
    cache = sluice.ModelCache(device="cpu")
    a = cache.load("anima-tiny", storage=torch.float8_e4m3fn, compute=torch.float32)
    model = a.stats()["model"]
    assert model["compute"]["dtype"] == "float32"
    assert sluice.inspect("anima-tiny", storage=torch.float8_e4m3fn) == sluice.inspect("anima-tiny",
                                                                                        "float8_e4m3fn")
    with pytest.raises(sluice.InvalidArgument, match="load: storage= takes a torch.dtype"):
        cache.load("anima-tiny", storage=8)


# --- devices ---------------------------------------------------------------------------------

def test_device_takes_a_torch_device_a_name_or_an_index():
    backend()
    m = toy()
    snap = snapshot(m)
    with offload(m, storage="bfloat16") as h:  # offload_helpers passes device=DEVICE, a name
        assert h.stats()["device"]["name"].split(":")[0] == DEVICE
    m2 = toy()
    with sluice.offload(m2, device=torch.device(DEVICE), storage="bfloat16") as h:
        assert m2.proj_in.weight.device.type == DEVICE
        with torch.no_grad():
            assert torch.equal(m2(on_device(x_in())).cpu(), toy()(x_in()))
    assert sluice.ModelCache(device=torch.device("cpu")).device == "cpu"
    acc = available_accelerator()
    if acc is None:  # no accelerator: an index names nothing
        for call in (lambda: sluice.offload(m, device=0), lambda: sluice.ModelCache(device=1)):
            with pytest.raises(ValueError, match=r"device=\d is an index of the current accelerator, and torch "
                                                 r"finds none available"):
                call()
    else:  # the current accelerator's device 0
        with sluice.offload(m, device=0, storage="bfloat16") as h:
            assert m.proj_in.weight.device == torch.device(acc, 0)
            assert h.stats()["device"]["name"].split(":")[0] == acc
    for bad, why in ((True, "takes a torch.device"), (-1, "negative index"), (1.0, "takes a torch.device"),
                     ("", "is empty")):
        with pytest.raises(sluice.InvalidArgument, match=f"offload: device=.*{why}"):
            sluice.offload(m, device=bad)
    assert_restored(m, snap)


def test_an_index_is_the_current_accelerators(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda check_available=False: torch.device("cuda"))
    assert _devices.device_name(1, "offload") == "cuda:1"
    assert _devices.device_name(torch.device("cuda", 2), "offload") == "cuda:2"
    assert _devices.device_name(" cuda:3 ", "offload") == "cuda:3"


# --- the default device ----------------------------------------------------------------------

def test_the_default_device_is_the_current_accelerator():
    backend()  # on the accel entry: the test accelerator's library loaded, its backend registered
    want = available_accelerator() or "cpu"
    if DEVICE != "cpu":
        assert want == DEVICE  # the PrivateUse1 test device is torch's current accelerator
    assert sluice.default_device() == want
    assert sluice.ModelCache().device == want
    m = toy()
    with torch.no_grad():
        ref = m(x_in())
    with sluice.offload(m, storage="bfloat16") as h:  # no cache, no device=
        assert h.stats()["device"]["name"].split(":")[0] == want
        assert m.proj_in.weight.device.type == want  # the placeholders are where it runs
        with torch.no_grad():
            assert torch.equal(m(x_in().to(want)).cpu(), ref)


def test_default_device_without_an_accelerator_and_on_older_torch(monkeypatch):
    acc = torch.accelerator
    monkeypatch.setattr(acc, "current_accelerator", lambda check_available=False: None)
    assert sluice.default_device() == "cpu"
    monkeypatch.setattr(acc, "current_accelerator",
                        lambda check_available=False: torch.device("xpu") if check_available else None)
    assert sluice.default_device() == "xpu"
    # A current_accelerator() without check_available: torch.accelerator.is_available() decides.
    monkeypatch.setattr(acc, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(acc, "is_available", lambda: False)
    assert sluice.default_device() == "cpu"
    monkeypatch.setattr(acc, "is_available", lambda: True)
    assert sluice.default_device() == "cuda"
    # A torch before torch.accelerator: CUDA (ROCm builds report cuda too), else the CPU.
    monkeypatch.delattr(torch, "accelerator")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert sluice.default_device() == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sluice.default_device() == "cpu"
    with pytest.raises(sluice.InvalidArgument, match="device=0 is an index of the current accelerator"):
        _devices.device_name(0, "offload")


# --- sizes -----------------------------------------------------------------------------------

def test_sizes_take_an_int_of_bytes_or_a_string():
    mib = 1 << 20
    m = toy()
    with offload(m, storage="bfloat16", vram_budget=64 * mib, working_memory=mib) as h:
        budget = h.stats()["budget"]
        assert budget["budget_bytes"] == 64 * mib and budget["working_memory_bytes"] == mib
        h.set_vram_budget(32 * mib)
        assert h.stats()["budget"]["budget_bytes"] == 32 * mib
        h.set_vram_budget("48MiB")
        assert h.stats()["budget"]["budget_bytes"] == 48 * mib
    with offload(m, storage="bfloat16", vram_budget="64MiB", working_memory="1MiB") as h:
        assert h.stats()["budget"]["budget_bytes"] == 64 * mib
    cache = sluice.ModelCache(device="cpu", vram_budget=64 * mib, working_memory=2 * mib, ram_limit=1 << 30,
                              pin_memory_limit=256 * mib)
    c = cache.stats()["cache"]
    assert (c["vram_budget_bytes"], c["working_memory_bytes"], c["ram_limit_bytes"], c["pin_limit_bytes"]) == \
        (64 * mib, 2 * mib, 1 << 30, 256 * mib)
    cache.set_vram_budget(32 * mib)
    assert cache.stats()["cache"]["vram_budget_bytes"] == 32 * mib
    # device_memory, a number on the C++ side, takes a size string too: 50% of 8GiB.
    for total in ("8GiB", 8 << 30):
        c = sluice.ModelCache(device="cpu", device_memory=total, vram_budget="50%").stats()["cache"]
        assert c["vram_budget_bytes"] == 4 << 30
    model = sluice.ModelCache(device="cpu").load("anima-tiny", storage="bfloat16")
    model.full_unload()
    by_int = model.partial_load(64 << 10)
    model.full_unload()
    assert model.partial_load("64KiB") == by_int > 0


@pytest.mark.parametrize("bad", [True, 1.5, -1, [1]])
def test_a_bad_size_is_one_invalid_argument_naming_it(bad):
    m = toy()
    snap = snapshot(m)
    for name in ("vram_budget", "working_memory"):
        with pytest.raises(sluice.InvalidArgument, match=f"offload: {name}=") as e:
            offload(m, **{name: bad})
        assert isinstance(e.value, ValueError) and "\n" not in str(e.value)
    assert_restored(m, snap, same_memory=True)  # nothing was taken
    for name in ("vram_budget", "working_memory", "ram_limit", "pin_memory_limit", "vram_headroom", "device_memory"):
        with pytest.raises(sluice.InvalidArgument, match=f"ModelCache: {name}="):
            sluice.ModelCache(device="cpu", **{name: bad})
    with pytest.raises(sluice.InvalidArgument, match="set_vram_budget: budget="):
        sluice.ModelCache(device="cpu").set_vram_budget(bad)
    with pytest.raises(sluice.InvalidArgument, match="partial_load: nbytes="):
        sluice.ModelCache(device="cpu").load("anima-tiny").partial_load(bad)


# --- InvalidArgument is a ValueError --------------------------------------------------------

def test_invalid_argument_is_a_value_error_and_still_a_sluice_error():
    assert issubclass(sluice.InvalidArgument, ValueError)
    assert issubclass(sluice.InvalidArgument, sluice.Error) and issubclass(sluice.Error, RuntimeError)
    assert not issubclass(sluice.ResourceError, ValueError) and not issubclass(sluice.FileError, ValueError)
    # Raised by the C++ side (the size parser) ...
    try:
        sluice.ModelCache(device="cpu", vram_budget="lots")
    except ValueError as e:
        assert type(e) is sluice.InvalidArgument and "lots" in str(e)
    else:
        pytest.fail("no error")
    # ... by the Python side ...
    with pytest.raises(ValueError, match="originals='tmp'"):
        offload(toy(), originals="tmp")
    # ... and raised by anyone, caught as either.
    for catch in (ValueError, sluice.Error, RuntimeError):
        with pytest.raises(catch, match="^mine$"):
            raise sluice.InvalidArgument("mine")


# --- the handle as a context manager --------------------------------------------------------

def test_with_offload_removes_on_exit():
    m = toy()
    x = x_in()
    with torch.no_grad():
        want = m(x)
    snap = snapshot(m)
    with offload(m, storage="bfloat16", max_resident=0.0) as h:
        assert isinstance(h, sluice.Offloaded) and not h.removed
        assert "forward" in m.__dict__
        with torch.no_grad():
            assert torch.equal(m(on_device(x)).cpu(), want)
        assert h.stats()["forward_count"] == 1
    assert h.removed
    assert_restored(m, snap)
    assert h.stats()["forward_count"] == 1  # the stats of the moment it was removed
    # remove() inside the block: the end of the block leaves it so.
    with offload(m, storage="bfloat16") as h:
        h.remove()
    assert h.removed
    assert_restored(m, snap)


def test_with_offload_removes_when_the_body_raises():
    m = toy()
    snap = snapshot(m)
    with pytest.raises(KeyError, match="the body's"):
        with offload(m, storage="bfloat16") as h:
            raise KeyError("the body's")
    assert h.removed
    assert_restored(m, snap)


def test_a_failing_remove_does_not_mask_the_bodys_exception(caplog):
    m = toy()
    snap = snapshot(m)

    def broken():
        raise sluice.ResourceError("remove failed on purpose")

    with caplog.at_level(logging.WARNING, logger="sluice"):
        with pytest.raises(KeyError, match="the body's") as e:
            with offload(m, storage="bfloat16") as h:
                h.remove = broken  # the instance's remove() fails at the end of the block
                raise KeyError("the body's")
    if hasattr(e.value, "add_note"):  # Python 3.11: remove()'s failure is noted on the body's exception
        assert any("remove failed on purpose" in note for note in e.value.__notes__)
    assert any("remove failed on purpose" in r.getMessage() for r in caplog.records if r.name == "sluice")
    del h.remove
    assert not h.removed
    h.remove()  # the real one still gives the module back
    assert_restored(m, snap)
    # Without an exception in the body, remove()'s own error is the one raised.
    with pytest.raises(sluice.ResourceError, match="remove failed on purpose"):
        with offload(m, storage="bfloat16") as h:
            h.remove = broken
    del h.remove
    h.remove()
    assert_restored(m, snap)
