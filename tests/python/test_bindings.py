"""The Python bindings (python/, imported from the freshly installed package): the same
bits as the C++ CLI, dtypes and stats, exceptions with the C++ messages, LoRA context
managers, and the GIL released during forward. Run by ctest through pytest; the CLI path
and a scratch folder come from the environment (SLUICE_CLI, SLUICE_TEST_TMP)."""
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

import sluice

CLI = os.environ["SLUICE_CLI"]


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(dir=os.environ.get("SLUICE_TEST_TMP")) as d:
        yield d


@pytest.fixture(scope="module")
def checkpoint(workdir):
    path = os.path.join(workdir, "tiny.safetensors")
    subprocess.run([CLI, "make-checkpoint", "--config", "anima-tiny", "--seed", "21", "--out", path], check=True)
    return path


def inputs(info, seed=0, batch=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, info["in_channels"], 1, 8, 8, generator=g)
    t = torch.full((batch,), 0.6)
    ctx = torch.randn(batch, 6, info["crossattn_emb_channels"], generator=g)
    return x, t, ctx


def test_forward_is_bit_identical_to_the_cli(checkpoint, workdir):
    cache = sluice.ModelCache(device="cpu")
    # bf16 pinned on both sides: compute "auto" would be fp32 on a CPU without native bf16.
    model = cache.load(checkpoint, storage="float8_e4m3fn", compute="bfloat16", max_resident=0.5)
    x, t, ctx = inputs(model.info)
    with model.lock() as m:
        v = m(x, t, ctx)
    ins, out = os.path.join(workdir, "in.safetensors"), os.path.join(workdir, "out.safetensors")
    save_file({"x": x, "timesteps": t, "context": ctx}, ins)
    subprocess.run([CLI, "forward", "--checkpoint", checkpoint, "--inputs", ins, "--output", out,
                    "--storage", "float8_e4m3fn", "--compute", "bfloat16", "--max-resident", "0.5"], check=True)
    cli_v = load_file(out)["velocity"]
    assert v.dtype == torch.bfloat16 and cli_v.dtype == torch.bfloat16
    assert v.shape == x.shape
    assert torch.equal(v, cli_v)
    # A different residency changes nothing (the same cache hit, fully resident now).
    model.full_load()
    with model.lock() as m:
        assert torch.equal(m(x, t, ctx), v)


def test_forward_reports_progress_per_layer(checkpoint):
    cache = sluice.ModelCache(device="cpu")
    model = cache.load(checkpoint, storage="float8_e4m3fn", max_resident=0.5)
    x, t, ctx = inputs(model.info)
    with model.lock() as m:
        ref = m(x, t, ctx)  # records the layer order
        calls = []
        v = m.forward(x, t, ctx, progress=lambda done, expected: calls.append((done, expected)))
        assert torch.equal(v, ref)
        n = len(calls)
        assert n > 0
        assert calls == [(i + 1, n) for i in range(n)]

        def broken(done, expected):
            raise ValueError("progress display closed")

        # A raising callback is logged once and dropped; the forward still returns.
        assert torch.equal(m.forward(x, t, ctx, progress=broken), ref)
        assert torch.equal(m.forward(x, t, ctx), ref)


def test_converted_checkpoint_reads_in_safetensors_and_loads_in_sluice(checkpoint, workdir):
    """`sluice convert` writes what the safetensors library reads as it is: fp8 weights,
    fp32 scalar scales, ComfyUI's _quantization_metadata; sluice loads it to the same
    velocity as converting at load time."""
    out = os.path.join(workdir, "tiny-fp8.safetensors")
    subprocess.run([CLI, "convert", checkpoint, "--scaled", "--out", out], check=True)
    tensors = load_file(out)
    w = tensors["net.blocks.0.mlp.layer1.weight"]
    assert w.dtype == torch.float8_e4m3fn
    scale = tensors["net.blocks.0.mlp.layer1.weight_scale"]
    assert scale.dtype == torch.float32 and scale.shape == ()
    assert tensors["net.t_embedder.1.linear_1.weight"].dtype == torch.bfloat16
    from safetensors import safe_open
    with safe_open(out, framework="pt") as f:
        meta = f.metadata()
    layers = json.loads(meta["_quantization_metadata"])["layers"]
    assert layers["net.blocks.0.mlp.layer1"] == {"format": "float8_e4m3fn", "full_precision_matrix_mult": True}
    assert meta["sluice.scale"] == "per_tensor"
    # Dequantized as a reader of this layout does (weight = fp8 * scale), close to the source.
    src = load_file(checkpoint)["net.blocks.0.mlp.layer1.weight"].float()
    assert torch.allclose(w.float() * scale, src, rtol=0.07, atol=1e-3)

    # Unscaled, the converted file holds the bytes a load-time conversion makes: the same velocity.
    plain = os.path.join(workdir, "tiny-fp8-plain.safetensors")
    subprocess.run([CLI, "convert", checkpoint, "--out", plain], check=True)
    velocities = []
    for path in (plain, checkpoint):
        cache = sluice.ModelCache(device="cpu")
        model = cache.load(path, storage="float8_e4m3fn")
        x, t, ctx = inputs(model.info)
        with model.lock() as m:
            velocities.append(m(x, t, ctx))
    assert torch.equal(velocities[0], velocities[1])


def test_stats_and_dtypes(checkpoint):
    cache = sluice.ModelCache(device="cpu")
    model = cache.load(checkpoint, max_resident=0.5)
    x, t, ctx = inputs(model.info)
    with model.lock() as m:
        m(x, t, ctx)
        m(x, t, ctx)
    s = model.stats()
    assert s["model"]["total_bytes"] > s["model"]["resident_bytes"] > 0
    assert len(s["forwards"]) == 2
    # The plan is made again from the second forward's measurements, after it.
    assert s["plan"]["from_measurements"]
    assert s["plan"]["predicted_step_ms"] > 0
    for f in s["forwards"]:
        # A DiT forward streams exactly the non-resident DiT layers of its plan (not the LLM adapter's).
        assert f["bytes_streamed"] == f["planned_bytes"] > 0
        for key in ("h2d_gbps", "stall_ms", "upcast_ms", "wall_ms"):
            assert key in f
    assert s["model"]["streamed_bytes_by_forward"]["dit"] > 0
    # One character per block: at half residency some blocks stream (S) or partly stream (P).
    blocks = s["model"]["residency"].split(";")[0]
    assert blocks.startswith("blocks: ")
    assert set(blocks[len("blocks: "):]) & {"S", "P"}
    cs = cache.stats()
    assert [m["model"]["total_bytes"] for m in cs["models"]] == [s["model"]["total_bytes"]]
    assert {"hits", "misses", "evictions"} <= set(cs["cache"])
    # Loading the same source with the same options is a hit.
    cache.load(checkpoint, max_resident=0.5)
    assert cache.stats()["cache"]["hits"] == cs["cache"]["hits"] + 1
    # compute="auto" (the default): the choice, its reason and the hardware are in the stats.
    assert s["model"]["compute"]["automatic"] is True
    assert s["model"]["compute"]["dtype"] == s["model"]["compute_dtype"] in ("bfloat16", "float32")
    assert s["model"]["compute"]["reason"].startswith("auto: " + s["model"]["compute_dtype"] + ", because ")
    assert s["hardware"].startswith("CPU ")
    explicit = cache.load("anima-tiny", compute="float32").stats()["model"]["compute"]
    assert explicit == {"dtype": "float32", "automatic": False, "reason": "requested"}


def test_errors_become_python_exceptions(checkpoint, workdir):
    cache = sluice.ModelCache(device="cpu")
    with pytest.raises(sluice.FileError, match="missing.safetensors"):
        cache.load(os.path.join(workdir, "missing.safetensors"))
    with pytest.raises(sluice.InvalidArgument, match="lots"):
        sluice.ModelCache(device="cpu", vram_budget="lots")
    with pytest.raises(sluice.InvalidArgument, match="float8_e4m3fn|compute"):
        cache.load(checkpoint, compute="float8_e4m3fn")
    model = cache.load(checkpoint)
    x, t, ctx = inputs(model.info)
    with model.lock() as m:
        with pytest.raises(sluice.InvalidArgument, match="x"):
            m(x[:, :1], t, ctx)
        # The model is still usable and every error is a sluice.Error.
        assert m(x, t, ctx).shape == x.shape
    assert issubclass(sluice.ResourceError, sluice.Error) and issubclass(sluice.Error, RuntimeError)
    cache.drop(model)
    with pytest.raises(sluice.Error):
        with model.lock():
            pass


def test_a_device_that_is_not_there_is_one_line_like_the_cli():
    if torch.cuda.is_available():
        missing = f"cuda:{torch.cuda.device_count() + 3}"
        with pytest.raises(sluice.InvalidArgument) as e:
            sluice.ModelCache(device=missing)
        assert "\n" not in str(e.value) and f"device '{missing}' does not exist" in str(e.value)
        return
    with pytest.raises(sluice.InvalidArgument) as e:
        sluice.ModelCache(device="cuda")
    assert str(e.value) == "device: 'cuda' requested but no CUDA/ROCm device is available"


def test_an_unknown_preset_is_named_with_the_known_ones(workdir):
    cache = sluice.ModelCache(device="cpu")
    with pytest.raises(sluice.InvalidArgument,
                       match=r"^unknown preset 'anima-nope' \(known: anima-2b, anima-tiny, anima-small, anima-medium, "
                             r"anima-2\.9b, anima-3\.8b; "):
        cache.load("anima-nope")
    # A path (a separator or a file suffix) is opened, and a missing one says so.
    for path in ("anima-nope.safetensors", os.path.join(workdir, "anima-nope"), "anima-nope.json"):
        with pytest.raises(sluice.FileError, match="cannot open"):
            cache.load(path)


def test_a_budget_above_the_device_memory_is_refused():
    with pytest.raises(sluice.InvalidArgument,
                       match=r"^vram_budget 10TB \(9\.1TiB\) is more than the \d+\.\d[KMGT]iB of memory of cpu"):
        sluice.ModelCache(device="cpu", vram_budget="10TB")


def test_nonfinite_inputs_are_named_and_locate_nonfinite_names_the_layer(checkpoint, workdir):
    cache = sluice.ModelCache(device="cpu")
    model = cache.load(checkpoint)
    x, t, ctx = inputs(model.info)
    bad = x.clone()
    bad[0, 2, 0, 5, 7] = float("nan")
    with model.lock() as m:
        with pytest.raises(sluice.InvalidArgument,
                           match=r"^forward: input 'x' has 1 non-finite value \(first at \[0, 2, 0, 5, 7\]: nan\)$"):
            m(bad, t, ctx)
        assert m.locate_nonfinite(x, t, ctx) is None
        # A LoRA whose residual overflows one layer's output: the first non-finite one.
        d = model.info["model_channels"]
        lora = os.path.join(workdir, "overflow.safetensors")
        save_file({"blocks.1.mlp.layer2.lora_A.weight": torch.full((1, 4 * d), 1e20),
                   "blocks.1.mlp.layer2.lora_B.weight": torch.full((d, 1), 1e20)}, lora)
        with m.lora(lora):
            assert not torch.isfinite(m(x, t, ctx)).all()
            r = m.locate_nonfinite(x, t, ctx)
        assert r["kind"] == "dit" and r["module"] == "blocks.1.mlp.layer2"
        assert 0 < r["nonfinite_values"] <= r["values"]
    s = model.stats()
    assert s["nonfinite"]["reruns"] == 2
    assert s["nonfinite"]["last"]["module"] == "blocks.1.mlp.layer2"


def test_lora_context_manager(checkpoint, workdir):
    cache = sluice.ModelCache(device="cpu")
    model = cache.load(checkpoint)
    x, t, ctx = inputs(model.info)
    d = model.info["model_channels"]
    g = torch.Generator().manual_seed(5)
    lora = os.path.join(workdir, "lora.safetensors")
    save_file({"diffusion_model.blocks.0.self_attn.q_proj.lora_A.weight": torch.randn(4, d, generator=g),
               "diffusion_model.blocks.0.self_attn.q_proj.lora_B.weight": torch.randn(d, 4, generator=g)}, lora)
    with model.lock() as m:
        before = m(x, t, ctx)
        with m.lora(lora, scale=0.5) as l:
            assert l.patched_layers == 1
            patched = m(x, t, ctx)
        after = m(x, t, ctx)
    assert not torch.equal(patched, before)
    assert torch.equal(after, before)


def every_block_lora(info, rank, path, seed=3):
    """A rank-`rank` LoRA on every Linear of every DiT block (attention and MLP)."""
    d = info["model_channels"]
    h = d * info["mlp_ratio"]
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for b in range(info["num_blocks"]):
        for name, n_in, n_out in (("self_attn.q_proj", d, d), ("self_attn.k_proj", d, d), ("self_attn.v_proj", d, d),
                                  ("self_attn.output_proj", d, d), ("mlp.layer1", d, h), ("mlp.layer2", h, d)):
            tensors[f"blocks.{b}.{name}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.02
            tensors[f"blocks.{b}.{name}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.02
    save_file(tensors, path)
    return path


@pytest.mark.parametrize("preset,rank", [("anima-small", 64), ("anima-small", 16), ("anima-tiny", 16)])
def test_a_lora_grows_the_share_into_the_free_budget_and_gives_it_back(workdir, preset, rank):
    # Issue 29, item 1: the share of a fully resident model had no room for sidecars, so a
    # LoRA was refused (or streamed every block) while most of the cache's budget was free.
    cache = sluice.ModelCache(device="cpu", vram_budget="4GiB")
    model = cache.load(preset)
    share = model.stats()["budget"]["share_bytes"]
    residency = model.residency_map()
    assert "S" not in residency.split(";")[0] and "P" not in residency.split(";")[0]  # fully resident
    path = every_block_lora(model.info, rank, os.path.join(workdir, f"{preset}-r{rank}.safetensors"))
    x, t, ctx = inputs(model.info)
    with model.lock() as m:
        plain = m(x, t, ctx)
        with m.lora(path):
            s = model.stats()
            sidecars = s["device"]["lora_bytes"]
            assert sidecars > 0
            assert s["budget"]["share_bytes"] == share + sidecars
            assert model.residency_map() == residency  # nothing more streams
            assert s["cache"]["vram_reserved_bytes"] == share + sidecars
            assert not torch.equal(m(x, t, ctx), plain)
        s = model.stats()
        assert s["device"]["lora_bytes"] == 0
        assert s["budget"]["share_bytes"] == share  # given back
        assert model.residency_map() == residency
        assert torch.equal(m(x, t, ctx), plain)


def test_a_budget_that_cannot_hold_the_sidecars_refuses_them_in_one_line(workdir):
    # Exactly the fully resident model beside 1 MiB of working memory: no free budget, and
    # sidecars eight times the fp8 weights cannot fit even with every layer streamed.
    share = sluice.ModelCache(device="cpu").load("anima-tiny").stats()["budget"]["share_bytes"]
    cache = sluice.ModelCache(device="cpu", vram_budget=str(share + (1 << 20)), working_memory="1MiB")
    model = cache.load("anima-tiny")
    assert model.stats()["budget"]["share_bytes"] == share
    residency = model.residency_map()
    path = every_block_lora(model.info, 64, os.path.join(workdir, "tiny-r64.safetensors"))
    x, t, ctx = inputs(model.info)
    with model.lock() as m:
        plain = m(x, t, ctx)
        with pytest.raises(sluice.ResourceError) as e:
            m.lora(path)
        msg = str(e.value)
        assert "\n" not in msg
        assert f"LoRA '{path}' needs " in msg and "model 'anima-tiny'" in msg and "missing" in msg
        # Nothing changed.
        s = model.stats()
        assert s["device"]["lora_bytes"] == 0 and s["budget"]["share_bytes"] == share
        assert model.residency_map() == residency
        assert torch.equal(m(x, t, ctx), plain)


def test_a_lora_does_not_outlive_its_lock(checkpoint, workdir):
    # Issue 29, item 2 (Note [LoRA lifetime]): unlocking removes the LoRAs made through the lock.
    cache = sluice.ModelCache(device="cpu")
    model = cache.load(checkpoint)
    x, t, ctx = inputs(model.info)
    path = every_block_lora(model.info, 4, os.path.join(workdir, "lifetime.safetensors"))
    lk = model.lock().acquire()
    plain = lk(x, t, ctx)
    lora = lk.lora(path)  # no `with`
    assert lora.active
    assert not torch.equal(lk(x, t, ctx), plain)
    assert model.stats()["device"]["lora_bytes"] > 0
    lk.unlock()
    assert not lora.active
    s = model.stats()
    assert s["device"]["lora_bytes"] == 0
    assert [m["locks"] for m in s["cache"]["models_held"]] == [0]
    with model.lock() as m:
        assert torch.equal(m(x, t, ctx), plain)  # bit for bit
    lora.remove()  # nothing left to do
    with pytest.raises(sluice.InvalidArgument, match="unlocked"):
        lk.lora(path)
    # The same at the end of the lock's `with` block, with the LoRA's own `with` still open.
    with model.lock() as m:
        kept = m.lora(path)
        with kept:
            pass
        again = m.lora(path)
    assert not again.active and not kept.active
    with model.lock() as m:
        assert torch.equal(m(x, t, ctx), plain)
    assert model.stats()["device"]["lora_bytes"] == 0


def test_stats_list_every_cached_model_and_each_total_is_the_sum_of_its_parts(checkpoint):
    # Issue 29, item 6 (Note [stats parts]).
    cache = sluice.ModelCache(device="cpu", vram_budget="4GiB")
    first = cache.load(checkpoint, max_resident=0.5, name="same")
    second = cache.load("anima-small", seed=4, name="same")
    for model in (first, second):
        with model.lock() as m:
            m(*inputs(model.info))
            m(*inputs(model.info))
    first_id = first.stats()["model"]["id"]
    del first  # its Python handle goes; the cache still holds the model
    gc.collect()
    s = cache.stats()
    models = s["models"]
    assert isinstance(models, list) and len(models) == 2
    assert [m["model"]["name"] for m in models] == ["same", "same"]
    assert [m["model"]["source"] for m in models] == [checkpoint, "anima-small"]
    assert models[0]["model"]["id"] == first_id != models[1]["model"]["id"]
    c = s["cache"]
    assert [(h["id"], h["name"], h["source"]) for h in c["models_held"]] == \
        [(m["model"]["id"], "same", m["model"]["source"]) for m in models]
    # The cache's device total is the sum of its models' parts.
    assert c["vram_unattributed_bytes"] == 0
    assert c["vram"]["current"] == sum(m["device"]["allocated_bytes"] for m in models) == c["models_allocated_bytes"]
    assert c["models_device_bytes"] == sum(m["device"]["current_bytes"] for m in models)
    assert c["vram_reserved_bytes"] == sum(m["budget"]["share_bytes"] for m in models)
    for m, h in zip(models, c["models_held"]):
        d = m["device"]
        assert h["device_bytes"] == d["current_bytes"] and h["allocated_bytes"] == d["allocated_bytes"]
        assert d["allocated_bytes"] <= d["current_bytes"]
        # The allocator's whole-device count: this model, the other, and what no model holds
        # (nothing on the CPU device between forwards).
        assert d["allocator_current_bytes"] == d["allocated_bytes"] + d["other_models_bytes"] + d["unattributed_bytes"]
        assert d["unattributed_bytes"] == 0
    # A model the cache dropped but that is still locked is held (and listed) until unlocked.
    lk = second.lock().acquire()
    cache.drop(second)
    held = cache.stats()
    assert [m["model"]["dropped"] for m in held["models"]] == [False, True]
    assert held["cache"]["vram"]["current"] == held["cache"]["models_allocated_bytes"]
    lk.unlock()
    assert [m["model"]["id"] for m in cache.stats()["models"]] == [first_id]


def test_forward_in_a_second_thread_releases_the_gil():
    # A forward long enough (about a second on a 2-core machine) that the main thread is
    # certainly scheduled while it runs, whatever the machine's load.
    cache = sluice.ModelCache(device="cpu")
    model = cache.load("anima-small", seed=3)
    info = model.info
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, info["in_channels"], 1, 32, 32, generator=g)
    t = torch.full((4,), 0.5)
    ctx = torch.randn(4, 8, info["crossattn_emb_channels"], generator=g)
    with model.lock() as m:
        reference = m(x, t, ctx)
    state = {"in_forward": False, "seen_in_forward": None, "result": None}
    started = threading.Event()

    def worker():
        with model.lock() as m:
            state["in_forward"] = True
            started.set()
            state["result"] = m(x, t, ctx)
            state["in_forward"] = False

    # With a huge switch interval Python never preempts a thread, so the main thread can
    # only run while the worker is inside forward if forward released the GIL.
    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        th = threading.Thread(target=worker)
        th.start()
        started.wait()
        state["seen_in_forward"] = state["in_forward"]
        th.join()
    finally:
        sys.setswitchinterval(old)
    assert state["seen_in_forward"] is True
    assert torch.equal(state["result"], reference)


def test_inspect_and_encode_text(checkpoint):
    info = sluice.inspect(checkpoint)
    assert info["model"] == "anima"
    assert info["parameters"] > 0
    fp8 = sluice.inspect("anima-2b", storage="float8_e4m3fn")
    assert fp8["param_size_mib"] == pytest.approx(2012.0)
    cache = sluice.ModelCache(device="cpu")
    model = cache.load(checkpoint)
    a = model.info["adapter"]
    with model.lock() as m:
        q = torch.randn(1, 5, a["source_dim"])
        ids = torch.randint(0, a["vocab_size"], (1, 5))
        c = m.encode_text(q, ids)
        assert c.shape == (1, a["output_tokens"], model.info["crossattn_emb_channels"])
        assert torch.equal(c[:, 5:], torch.zeros_like(c[:, 5:]))
        with pytest.raises(sluice.InvalidArgument, match="t5_ids"):
            m.encode_text(q, torch.full((1, 5), a["vocab_size"]))


def test_ctrl_c_stops_a_forward_within_a_layer_and_the_next_forward_is_clean():
    """Issue 29, item 10: a KeyboardInterrupt arrived only once the forward returned (7.6 s in
    the report). A forward on the main thread checks for signals between layers: SIGINT
    stops it before its next layer, as an exception would, and the model stays as it was."""
    import signal
    import time

    cache = sluice.ModelCache(device="cpu")
    model = cache.load("anima-medium", seed=5, max_resident=0.5)
    info = model.info
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, info["in_channels"], 1, 64, 64, generator=g)  # 512 px, batch 2: about a second
    t = torch.full((2,), 0.5)
    ctx = torch.randn(2, 16, info["crossattn_emb_channels"], generator=g)

    def interrupted(call, delay, at_signal=None):
        """Runs call() with SIGINT sent from a timer thread `delay` s in. Returns the seconds
        from the signal to the KeyboardInterrupt (None when none came)."""
        sent = []

        def kill():
            sent.append(time.monotonic())
            if at_signal is not None:
                at_signal()
            os.kill(os.getpid(), signal.SIGINT)

        timer = threading.Timer(delay, kill)
        timer.start()
        try:
            call()
            timer.join()
            time.sleep(1.0)  # a SIGINT that came after the forward is raised here
        except KeyboardInterrupt:
            timer.join()
            return time.monotonic() - sent[0]
        return None

    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with model.lock() as m:
            layers = []
            m.forward(x, t, ctx, progress=lambda done, expected: layers.append(done))  # records the order
            n = len(layers)
            start = time.monotonic()
            clean = m(x, t, ctx)
            clean_s = time.monotonic() - start

            # The plain call, as a script makes it: stopped well before the forward would end.
            elapsed = interrupted(lambda: m(x, t, ctx), clean_s / 4)
            assert elapsed is not None
            assert elapsed < clean_s / 2, f"KeyboardInterrupt {elapsed:.3f} s after SIGINT; a forward takes {clean_s:.3f} s"
            assert torch.equal(m(x, t, ctx), clean)

            # With a progress callback, counted in layers: at most the layer running when the
            # signal came and the one whose callback saw it.
            done = []
            seen = {}
            elapsed = interrupted(lambda: m.forward(x, t, ctx, progress=lambda d, e: done.append(d)), clean_s / 4,
                                  at_signal=lambda: seen.setdefault("layers", len(done)))
            assert elapsed is not None
            assert 0 < seen["layers"] <= len(done) <= seen["layers"] + 2 < n
            assert torch.equal(m(x, t, ctx), clean)
            # And a forward after all that is not interrupted.
            assert torch.equal(m.forward(x, t, ctx, progress=lambda d, e: None), clean)
    finally:
        signal.signal(signal.SIGINT, old)


def test_option_structs_take_their_fields_as_keywords():
    # Note [field lists]: the options' keywords, defaults and attributes come from the C++
    # structs' one field list; an unknown keyword or a wrong type is a TypeError naming it.
    from sluice import _C

    o = _C.RuntimeOptions()
    assert (o.device, o.resolution, o.prefetch, o.policy, o.timing, o.trace) == ("cpu", 1024, "auto", "balanced", True, False)
    o = _C.RuntimeOptions(device="cpu", prefetch=3, resolution=512, cpu_copy_latency_us=2.5, load_threads=1)
    assert (o.prefetch, o.resolution, o.cpu_copy_latency_us, o.load_threads) == ("3", 512, 2.5, 1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'vram_budgt'"):
        _C.RuntimeOptions(vram_budgt="50%")
    with pytest.raises(TypeError, match="'resolution' has the wrong type"):
        _C.RuntimeOptions(resolution="big")
    lo = _C.LoadOptions(max_resident=None, extra_skips=["blocks.0"], seed=7)
    assert (lo.storage, lo.compute, lo.max_resident, lo.extra_skips, lo.seed) == ("float8_e4m3fn", "auto", None, ["blocks.0"], 7)
    assert _C.LoadOptions(max_resident=0.5).max_resident == 0.5
    with pytest.raises(TypeError, match="unexpected keyword argument 'storge'"):
        _C.LoadOptions(storge="bfloat16")


def test_lora_block_layout_remaps_a_base_lora_onto_a_40_block_model(workdir, caplog):
    """README, "The depth-expanded Anima-2.9B and Anima-3.8B, and adapters trained on a shallower
    model": a LoRA on blocks 0..27 goes to the 2.9B's positions of the base blocks (block_layout
    "measured", the default, one INFO line), or by index ("as-is")."""
    import logging
    from sluice import _logging
    config = os.path.join(workdir, "tiny40.json")
    with open(config, "w") as f:
        json.dump({"preset": "anima-tiny", "num_blocks": 40}, f)
    ckpt = os.path.join(workdir, "tiny40.safetensors")
    subprocess.run([CLI, "make-checkpoint", "--config", config, "--seed", "8", "--out", ckpt], check=True)
    new_blocks = {2, 5, 8, 11, 14, 17, 21, 24, 27, 30, 33, 36}  # Anima-2.9B's added blocks
    base_in_40 = [b for b in range(40) if b not in new_blocks]
    assert len(base_in_40) == 28

    def write(path, blocks):
        tensors = {}
        for i, b in enumerate(blocks):
            g = torch.Generator().manual_seed(50 + i)
            tensors[f"diffusion_model.blocks.{b}.mlp.layer1.lora_A.weight"] = torch.randn(2, 64, generator=g) * 0.3
            tensors[f"diffusion_model.blocks.{b}.mlp.layer1.lora_B.weight"] = torch.randn(256, 2, generator=g) * 0.3
        save_file(tensors, path)
        return path

    base = write(os.path.join(workdir, "base28.safetensors"), range(28))
    placed = write(os.path.join(workdir, "placed40.safetensors"), base_in_40)
    log = logging.getLogger("sluice")
    before = log.level
    try:
        log.setLevel(logging.INFO)
        cache = sluice.ModelCache(device="cpu")  # tells the engine the level
        model = cache.load(ckpt, max_resident=0.5)
        assert model.info["num_blocks"] == 40  # inferred from the checkpoint
        x, t, ctx = inputs(model.info)
        with model.lock() as m:
            with caplog.at_level(logging.INFO, logger="sluice"):
                with m.lora(base) as l:
                    assert l.patched_layers == 28
                    remapped = m(x, t, ctx)
                _logging.flush()
            with m.lora(placed, block_layout="measured"):  # a 40-block LoRA on 40 blocks: as is
                at_positions = m(x, t, ctx)
            with m.lora(base, block_layout="as-is"):
                by_index = m(x, t, ctx)
            plain = m(x, t, ctx)
            with pytest.raises(sluice.InvalidArgument, match=r"^block_layout 'sideways' is not one of: measured, as-is$"):
                m.lora(base, block_layout="sideways")
            with pytest.raises(ValueError):  # sluice.InvalidArgument is a ValueError
                m.lora(base, block_layout="")
    finally:
        log.setLevel(before)
    assert torch.equal(remapped, at_positions)
    assert not torch.equal(by_index, remapped) and not torch.equal(remapped, plain)
    lines = [r.getMessage() for r in caplog.records if r.name == "sluice" and "was trained on a 28-block Anima" in r.getMessage()]
    assert lines == [f"LoRA '{base}' was trained on a 28-block Anima: its blocks go to their measured positions in "
                     f"this 40-block model (block 2 -> 3, ..., 27 -> 39); block_layout \"as-is\" "
                     f"(--adapter-blocks as-is) turns this off"]

    # A 40-block LoRA on anima-tiny (2 blocks): refused, naming it, its block and the depth.
    cache = sluice.ModelCache(device="cpu")
    tiny = cache.load("anima-tiny", seed=1)
    with tiny.lock() as m:
        with pytest.raises(sluice.CheckpointError,
                           match=r"^LoRA '.*placed40\.safetensors' addresses block 39 \(trained on a 40-block Anima\), "
                                 r"but this model has 2 blocks: an adapter for a deeper model cannot be applied$"):
            m.lora(placed)
