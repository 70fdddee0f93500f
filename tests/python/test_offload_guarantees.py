"""What sluice.offload(module) promises for modules as frontends hold them (issue 37), on toy
modules: every weight read outside its layer's own call raises instead of reading zeros;
Linear subclasses stream and run their own forward; layers that cannot be leased are named
with the reason; a module inside or around an offloaded one, and torch.compile()'s wrapper,
are refused; a write in place is refused, and a write through a reference kept from before
reaches no budget's output; remove() puts back exactly the attributes that were there; the
wrapped forward keeps its signature; a budget too small names working_memory=; and
offload()/remove() hand the layers over one at a time, so host memory peaks near the
module's own bytes. On the CPU device (plain and strict) and the torch test accelerator."""
import ctypes
import functools
import inspect
import logging

import pytest
import torch
import torch.nn.functional as F

import sluice
from offload_helpers import DEVICE, assert_restored, offload, on_device, snapshot, status_bytes

torch.set_num_threads(1)


class Block(torch.nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.q = torch.nn.Linear(d, d)
        self.k = torch.nn.Linear(d, d)
        self.out = torch.nn.Linear(d, d)

    def forward(self, x):
        return self.out(torch.tanh(self.q(x)) * self.k(x))


class Net(torch.nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(d) for _ in range(2)])
        self.head = torch.nn.Linear(d, 8)

    def forward(self, x, scale: float = 1.0):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x) * scale


def net():
    torch.manual_seed(0)
    return Net().to(torch.bfloat16)


def x_in():
    return torch.randn(3, 32, dtype=torch.bfloat16)


def ref(m, x, **kw):
    """The module as it is, on the host: what the offloaded module must compute."""
    with torch.no_grad():
        return m(x, **kw)


def run(m, x, **kw):
    """The offloaded module, its input on the device sluice streams to."""
    with torch.no_grad():
        return m(on_device(x), **kw).cpu()


# --- never a silent zero -------------------------------------------------------------------

def test_weights_read_outside_their_layers_call_raise_naming_the_layer():
    class FusedQKV(Block):
        def forward(self, x):  # as DoRA-style and fused-attention code does
            qk = F.linear(x, torch.cat([self.q.weight, self.k.weight]), torch.cat([self.q.bias, self.k.bias]))
            q, k = qk.chunk(2, dim=-1)
            return self.out(torch.tanh(q) * k)

    m = net()
    m.blocks[1] = FusedQKV().to(torch.bfloat16)
    m.blocks[1].load_state_dict(net().blocks[1].state_dict())
    x = x_in()
    want = ref(m, x)
    h = offload(m, storage="bfloat16", max_resident=0.0)
    with pytest.raises(sluice.InvalidArgument, match=r"'blocks\.1\.q\.weight' is streamed.*exclude=\['blocks\.1\.q'\]"):
        run(m, x)
    w = m.blocks[0].q.weight
    assert w.shape == (32, 32) and w.dtype == torch.bfloat16 and w.requires_grad is False
    assert w.device.type == torch.device(DEVICE).type and m.blocks[0].q.weight.ndim == 2
    for read in (lambda: w + 1, lambda: w.sum(), lambda: w.data, lambda: torch.cat([w]), lambda: w.float(),
                 lambda: F.linear(torch.ones(1, 32, dtype=torch.bfloat16, device=w.device), w), lambda: w.tolist()):
        with pytest.raises(sluice.InvalidArgument, match=r"'blocks\.0\.q\.weight' is streamed"):
            read()
    assert "OffloadedParameter('blocks.0.q.weight'" in repr(w)
    h.remove()
    # Kept out of streaming, the fused layers read their real weights.
    h = offload(m, storage="bfloat16", max_resident=0.0, exclude=["blocks.1.q", "blocks.1.k"])
    assert torch.equal(run(m, x), want)
    names = {e["layer"]: e["reason"] for e in h.stats()["not_streamed"]}
    assert names == {"blocks.1.q": "exclude= names it", "blocks.1.k": "exclude= names it"}
    h.remove()


def test_a_patch_restored_with_del_forward_runs_the_layers_own_forward_not_zeros():
    m = net()
    x = x_in()
    want = ref(m, x)
    h = offload(m, storage="bfloat16", max_resident=0.0)
    lin = m.blocks[0].q
    org = lin.forward
    lin.forward = lambda t: org(t) * 0 + org(t)  # a ControlNet-style patch ...
    assert torch.equal(run(m, x), want)
    del lin.forward                               # ... restored the way patches are
    assert torch.equal(run(m, x), want)
    h.remove()


# --- what streams, what stays, and how it is reported ----------------------------------------

class CastLinear(torch.nn.Linear):
    """comfy.ops' manual-cast Linear: weight and bias cast to the input's dtype and device."""

    def forward(self, x):
        w = self.weight.to(dtype=x.dtype, device=x.device)
        b = None if self.bias is None else self.bias.to(dtype=x.dtype, device=x.device)
        return F.linear(x, w, b)


def test_linear_subclasses_stream_and_layers_that_cannot_be_leased_are_named(caplog):
    torch.manual_seed(1)
    m = net()
    m.blocks[0].q = CastLinear(32, 32).to(torch.bfloat16)
    m.emb = torch.nn.Embedding(10, 32, max_norm=1.0).to(torch.bfloat16)
    m.tied = torch.nn.Linear(32, 32).to(torch.bfloat16)
    m.tied.weight = m.blocks[1].out.weight
    x = x_in()
    want = ref(m, x)
    with caplog.at_level(logging.INFO, logger="sluice"):
        h = offload(m, storage="bfloat16", max_resident=0.0)
    assert torch.equal(run(m, x), want)
    stats = h.stats()
    assert stats["model"]["layers"] == 6  # q (the subclass), k, out of block 0; q, k of block 1; head
    assert {e["layer"]: e["reason"] for e in stats["not_streamed"]} == {
        "blocks.1.out": "its weight is shared with another module (tied weights)",
        "emb": "its lookup renormalises the table in place (max_norm)",
        "tied": "its weight is shared with another module (tied weights)"}
    lines = [r.getMessage() for r in caplog.records if r.name == "sluice" and "ordinary parameters" in r.getMessage()]
    assert len(lines) == 1 and "blocks.1.out (its weight is shared" in lines[0] and "emb (its lookup" in lines[0]
    h.remove()


# --- nested offloading, compiled modules ----------------------------------------------------

def test_nested_offloading_and_compiled_modules_are_refused():
    m = net()
    snap = snapshot(m)
    inner = offload(m.blocks[1], storage="bfloat16")
    with pytest.raises(sluice.InvalidArgument, match=r"submodule 'blocks\.1' is already offloaded"):
        offload(m, storage="bfloat16")
    inner.remove()
    outer = offload(m, storage="bfloat16")
    with pytest.raises(sluice.InvalidArgument, match=r"the module is already offloaded \(in 'Net'\)"):
        offload(m.blocks[0], storage="bfloat16")
    outer.remove()
    assert_restored(m, snap)
    compiled = torch.compile(net())
    with pytest.raises(sluice.InvalidArgument, match=r"torch\.compile\(\)'s wrapper.*_orig_mod"):
        offload(compiled)


# --- weights changed in place ----------------------------------------------------------------

@pytest.mark.parametrize("resident", [0.0, 1.0])
def test_writes_in_place_are_refused_and_old_references_reach_no_output(resident):
    m = net()
    x = x_in()
    want = ref(m, x)
    alias = m.head.weight.detach()  # a reference kept from before offload(), as a patcher keeps one
    h = offload(m, storage="bfloat16", max_resident=resident)
    with pytest.raises(sluice.InvalidArgument, match=r"'head\.weight' is streamed.*'add_'"):
        with torch.no_grad():
            m.head.weight.add_(1)
    with pytest.raises(sluice.InvalidArgument, match=r"'head\.weight' is streamed"):
        m.head.weight.data.copy_(torch.zeros(8, 32))
    alias.mul_(3)  # sluice holds its own copy: neither a resident nor a streamed layer sees this
    assert torch.equal(run(m, x), want)
    h.remove()


# --- what remove() gives back ----------------------------------------------------------------

def test_remove_puts_back_exactly_the_attributes_that_were_there():
    m = net()
    x = x_in()
    own = functools.partial(Net.forward, m)
    m.forward = own                   # a frontend's instance forward on the module
    lin = m.blocks[0].q
    patched = functools.partial(torch.nn.Linear.forward, lin)
    lin.forward = patched             # and on a layer
    want = ref(m, x)
    h = offload(m, storage="bfloat16", max_resident=0.0)
    assert torch.equal(run(m, x), want)
    h.remove()
    assert m.__dict__["forward"] is own and lin.__dict__["forward"] is patched
    for sub in m.modules():
        assert "_call_impl" not in sub.__dict__ and "_apply" not in sub.__dict__
        assert not any(k.startswith("_sluice") for k in sub.__dict__)
    assert type(lin.weight) is torch.nn.Parameter and "_sluice_layer" not in lin.weight.__dict__
    # A forward the frontend replaced while offloaded stays the frontend's.
    h = offload(m, storage="bfloat16")
    mine = functools.partial(Net.forward, m)
    m.forward = mine
    h.remove()
    assert m.__dict__["forward"] is mine


def test_the_wrapped_forward_keeps_the_modules_signature():
    m = net()
    x = x_in()
    want = ref(m, x, scale=2.0)
    h = offload(m, storage="bfloat16")
    assert "scale" in inspect.signature(m.forward).parameters
    assert m.forward.__wrapped__ is not None
    assert torch.equal(run(m, x, scale=2.0), want)
    h.remove()


def test_a_budget_too_small_names_working_memory():
    with pytest.raises(sluice.ResourceError, match="working_memory="):
        offload(net(), storage="bfloat16", vram_budget="64KiB")


# --- mixed dtypes, toy ------------------------------------------------------------------------

def test_a_mixed_dtype_module_needs_no_compute_and_each_layer_computes_in_its_own_dtype():
    m = net()
    m.head.float()  # an fp32 layer in a bf16 model (as _keep_in_fp32_modules leaves one)

    def forward(x, scale=1.0):
        for b in m.blocks:
            x = x + b(x)
        return m.head(x.float()) * scale

    m.forward = forward
    x = x_in()
    want = ref(m, x)
    snap = snapshot(m)
    h = offload(m, storage="bfloat16", max_resident=0.0)
    got = run(m, x)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    h.remove()
    assert m.head.weight.dtype == torch.float32
    # compute= changes the layers stored lossily; the fp32 layer kept by skip= stays fp32.
    h = offload(m, storage="float8_e4m3fn", compute=torch.bfloat16, skip=["head"])
    assert run(m, x).dtype == torch.float32
    h.remove()
    del m.forward
    assert_restored(m, snap)


# --- host memory at the peak (Note [handover]) -------------------------------------------------

def _reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("cannot reset the peak RSS here")


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn"])
def test_offload_and_remove_peak_near_the_modules_own_bytes(storage):
    if DEVICE != "cpu":
        pytest.skip("on the test accelerator its device memory is host memory too")
    ctypes.CDLL(None).malloc_trim(0)  # what earlier tests freed, out of the base (glibc)
    base = status_bytes("VmRSS")  # the process without the model
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False, dtype=torch.bfloat16) for _ in range(16)])
    model_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    layer_bytes = model_bytes // 16
    _reset_peak()
    h = offload(m, storage=storage, max_resident=0.0, pin_memory="off")
    peak_offload = status_bytes("VmHWM") - base
    _reset_peak()
    h.remove()
    peak_remove = status_bytes("VmHWM") - base
    # The target: 1.1x the module plus one layer's stored copy; 16 MiB more for the staging ring,
    # which on the CPU device is host memory too. Before issue 37 every layer was taken at
    # once: 2x (bf16) and 1.5x (fp8) here.
    for what, peak in (("offload()", peak_offload), ("remove()", peak_remove)):
        assert peak <= 1.1 * model_bytes + layer_bytes + (16 << 20), \
            f"{what} peaked at {peak / model_bytes:.2f}x the module's {model_bytes >> 20} MiB"


# --- what the stats and the log say -----------------------------------------------------------

def test_reloads_in_a_shared_cache_are_bytes_moved_and_parts_are_the_modules_own():
    a, b = net(), net()
    x = x_in()
    want = ref(a, x), ref(b, x)
    size = sum(t.numel() * t.element_size() for t in a.state_dict().values())
    mib = 1 << 20
    # Room for one module and a half beside the working memory: each forward takes the device
    # from the other module, which then loads its layers again at its next forward.
    cache = sluice.ModelCache(device=DEVICE, vram_budget=str(mib + size * 3 // 2), working_memory=str(mib))
    ha = sluice.offload(a, cache=cache, name="a", storage="bfloat16")
    hb = sluice.offload(b, cache=cache, name="b", storage="bfloat16")
    for _ in range(3):
        assert torch.equal(run(a, x), want[0])
        assert torch.equal(run(b, x), want[1])
    forwards = ha.stats()["forwards"]
    assert len(forwards) == 3
    # Each forward after the first found its layers gone: what it loaded is counted.
    assert all(f["bytes_loaded"] + f["bytes_streamed"] > 0 for f in forwards[1:])
    assert sum(f["bytes_loaded"] for f in forwards[1:]) > 0
    model = ha.stats()["model"]
    assert "streamed_bytes_by_forward" not in model  # Anima's dit/adapter split is not this module's
    assert set(model["streamed_bytes_by_part"]) <= {"blocks", "head"}
    ha.remove()
    hb.remove()


def test_sluice_log_lines_reach_pythons_logging_at_a_level_that_can_change(caplog):
    log = logging.getLogger("sluice")
    before = log.level
    x = x_in()
    try:
        log.setLevel(logging.INFO)
        with caplog.at_level(logging.INFO, logger="sluice"):
            h = offload(net(), storage="bfloat16", name="logged")
            h.remove()
        engine = [r for r in caplog.records if r.name == "sluice" and "'logged'" in r.getMessage()]
        assert engine and all(r.levelno == logging.INFO for r in engine)  # the engine's own lines, from C++
        caplog.clear()
        log.setLevel(logging.WARNING)  # changed at run time: the next calls log at that level
        with caplog.at_level(logging.WARNING, logger="sluice"):
            m = net()
            h = offload(m, storage="bfloat16", name="quiet")
            run(m, x)
            h.remove()
        assert not [r for r in caplog.records if r.name == "sluice" and r.levelno < logging.WARNING]
    finally:
        log.setLevel(before)


def test_an_fp8_embedding_looks_up_rows_without_upcasting_its_table():
    torch.manual_seed(2)
    emb = torch.nn.Sequential(torch.nn.Embedding(4096, 256), torch.nn.Linear(256, 8)).to(torch.bfloat16)
    ids = torch.tensor([[1, 4095, 7, 7, 300]])
    table = emb[0].weight.detach().clone()
    want = torch.nn.functional.linear(
        torch.nn.functional.embedding(ids, table.to(torch.float8_e4m3fn).to(torch.bfloat16)),
        emb[1].weight.detach().to(torch.float8_e4m3fn).to(torch.bfloat16),
        emb[1].bias.detach().to(torch.float8_e4m3fn).to(torch.bfloat16))
    for resident in (0.0, 1.0):
        h = offload(emb, storage="float8_e4m3fn", skip=[], max_resident=resident)
        assert torch.equal(run(emb, ids), want)
        scratch = h.stats()["device"]["by_kind"]["scratch"]["peak"]
        h.remove()
        # The whole table upcast would be 4096 x 256 bf16 = 2 MiB of scratch; the rows are 2.5 KiB.
        assert scratch < table.numel() * 2 // 4, scratch


def test_a_layer_called_twice_per_forward_is_prefetched_for_each_call():
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(64, 64)
            self.shared = torch.nn.Linear(64, 64)
            self.b = torch.nn.Linear(64, 64)

        def forward(self, x):
            return self.b(self.shared(torch.relu(self.shared(self.a(x)))))

    torch.manual_seed(4)
    m = Twice().to(torch.bfloat16)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    want = ref(m, x)
    h = offload(m, storage="bfloat16", max_resident=0.0)
    for _ in range(4):
        assert torch.equal(run(m, x), want)
    last = h.stats()["forwards"][-1]
    h.remove()
    assert last["copies"] == 4 and last["demand_copies"] == 0 and not last["diverged"]
    assert last["bytes_streamed"] == last["planned_bytes"]


def test_a_forward_off_the_recorded_order_says_so(caplog):
    class Either(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(32, 32)
            self.b = torch.nn.Linear(32, 32)

        def forward(self, x, swap=False):
            first, second = (self.b, self.a) if swap else (self.a, self.b)
            return second(torch.tanh(first(x)))

    torch.manual_seed(5)
    m = Either().to(torch.bfloat16)
    x = x_in()
    want = ref(m, x, swap=True)
    log = logging.getLogger("sluice")
    before = log.level
    try:
        log.setLevel(logging.INFO)
        with caplog.at_level(logging.INFO, logger="sluice"):
            h = offload(m, storage="bfloat16", max_resident=0.0, name="either")
            run(m, x)
            run(m, x)
            assert torch.equal(run(m, x, swap=True), want)
        records = h.stats()["forwards"]
        h.remove()
    finally:
        log.setLevel(before)
    assert [f["diverged"] for f in records] == [False, False, True]
    lines = [r.getMessage() for r in caplog.records if "another order than the one recorded" in r.getMessage()]
    assert len(lines) == 1 and "model 'either': forward 2" in lines[0]


def test_the_working_memory_of_an_offloaded_module_is_measured_and_grown():
    if DEVICE == "cpu":
        pytest.skip("the CPU device counts sluice's own bytes only: a module's activations are torch's host "
                    "tensors there (measured on the test accelerator and on a GPU)")

    class Wide(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(1024, 1024)
            self.b = torch.nn.Linear(1024, 1024)

        def forward(self, x):
            h = self.a(x)
            wide = h.repeat(1, 12)  # 4096 x 12288 bf16: 96 MiB of activations
            return self.b(h) + wide[:, :1024]

    m = Wide().to(torch.bfloat16)
    x = torch.randn(4096, 1024, dtype=torch.bfloat16)
    h = offload(m, storage="bfloat16", working_memory="64MiB")
    run(m, x)
    run(m, x)
    st = h.stats()
    h.remove()
    # Note [measured working memory]: the first forward measures what it used beyond sluice's
    # own bytes, and the cache's working memory grows to it (plus an eighth).
    assert st["budget"]["measured_working_memory_bytes"] >= 96 << 20
    assert st["cache"]["working_memory_bytes"] >= st["budget"]["measured_working_memory_bytes"]


def test_a_checkpoint_loaded_mapped_is_unmapped_once_offloaded(tmp_path):
    """Note [mapped checkpoints]: from_pretrained maps the safetensors file and its tensors are
    views of it; none of them may keep the whole file resident while sluice holds the copy."""
    diffusers = pytest.importorskip("diffusers")
    from offload_helpers import COSMOS_CONFIG

    torch.manual_seed(0)
    diffusers.CosmosTransformer3DModel(**COSMOS_CONFIG).to(torch.bfloat16).save_pretrained(tmp_path)
    m = diffusers.CosmosTransformer3DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)

    def mapped():
        with open("/proc/self/maps") as f:
            return [line for line in f if str(tmp_path) in line]

    assert mapped(), "from_pretrained did not map the checkpoint: nothing to check here"
    snap = snapshot(m)
    h = offload(m, storage="bfloat16", max_resident=0.0)
    assert not mapped()
    h.remove()
    assert_restored(m, snap)


def test_a_module_that_is_itself_one_layer_streams():
    torch.manual_seed(6)
    lin = torch.nn.Linear(32, 16).to(torch.bfloat16)
    x = x_in()
    want = ref(lin, x)
    snap = snapshot(lin)
    h = offload(lin, storage="bfloat16", max_resident=0.0)
    assert torch.equal(run(lin, x), want)
    assert h.stats()["model"]["layers"] == 1
    with pytest.raises(sluice.InvalidArgument, match=r"'Linear\.weight' is streamed"):
        lin.weight.sum()
    h.remove()
    assert_restored(lin, snap)
