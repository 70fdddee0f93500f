"""sluice: run large diffusion transformers on GPUs too small to hold them.

    import torch, sluice
    cache = sluice.ModelCache(device="cuda", vram_budget="50%")
    model = cache.load("anima.safetensors", storage="float8_e4m3fn")
    with model.lock() as m:
        v = m(x, timesteps, context)
    cache.stats()   # {"cache": counters, "models": [--stats-json document of every cached model]}

Tensors are passed zero-copy as torch tensors. Errors are sluice.Error subclasses
(FileError, CheckpointError, InvalidArgument, ResourceError) carrying the C++ message;
InvalidArgument is a ValueError too. Arguments follow PyTorch's conventions: a dtype is a
torch.dtype or its name, a device a torch.device, a name ("cuda", "cuda:1", "cpu") or an
index of the current accelerator (default: sluice.default_device(), the current
accelerator, "cpu" only when there is none), a size an int (bytes) or a string ("6GiB",
"50%").
The GIL is released while sluice loads, locks and runs forwards. Ctrl-C stops a forward
called on the main thread at its next layer (KeyboardInterrupt), leaving the model as it was.
"""
from __future__ import annotations

import json
import math
from typing import Callable, Iterable, List, Optional, Sequence, Union

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C
from ._C import CheckpointError, Error, FileError, InvalidArgument, ResourceError
from . import _logging
from ._arguments import dtype_name, size_bytes, size_text
from ._devices import default_device, device_name
from .offload import Offloaded, offload

__all__ = [
    "ModelCache", "Runtime", "Model", "LockedModel", "Lora", "LLLite", "inspect", "version", "offload", "Offloaded",
    "default_device",
    "Error", "FileError", "CheckpointError", "InvalidArgument", "ResourceError",
]
__version__ = _C.version()
_logging.start()  # sluice's log lines go to logging.getLogger("sluice") (sluice/_logging.py)


def version() -> str:
    """The library version, "MAJOR.MINOR.PATCH"."""
    return _C.version()


class Lora:
    """A LoRA applied to a locked model; a context manager that removes it on exit.

    A LoRA lives no longer than the lock it was made from (Note [LoRA lifetime] in
    sluice.hpp): it is removed by remove(), by the end of its `with` block, or when that lock
    is unlocked (LockedModel.unlock(), the end of the lock's `with` block), whichever comes
    first. Removed, the model's forwards give the unpatched outputs bit for bit and its
    sidecars' device bytes are given back; `active` is then False and remove() does nothing.
    """

    def __init__(self, handle: _C.LoraHandle):
        self._handle = handle

    @property
    def patched_layers(self) -> int:
        return self._handle.patched_layers

    @property
    def active(self) -> bool:
        return self._handle.active

    def remove(self) -> None:
        self._handle.remove()

    def __enter__(self) -> "Lora":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


class LLLite:
    """A ControlNet-LLLite adapter bound to a locked model; a context manager that unbinds it
    on exit. Its lifetime is a LoRA's (see Lora): it goes at the latest when its lock ends.

    Step range (InvokeAI's Anima denoise node): with `begin`/`end` fractions, call
    `step(i, steps)` before the model calls of step i of `steps`; the adapter then runs at
    `weight` for floor(begin * steps) <= i <= ceil(end * steps) and passes through (weight 0)
    elsewhere:

        with locked.lllite("canny.safetensors", image, weight=0.8, begin=0.0, end=0.5) as ll:
            for i in range(steps):
                ll.step(i, steps)
                v = locked(x, sigmas[i:i + 1], ctx)
    """

    def __init__(self, handle: _C.LLLiteHandle, weight: float, begin: float, end: float):
        self._handle = handle
        self.weight = weight
        self.begin = begin
        self.end = end

    @property
    def modules(self) -> int:
        return self._handle.modules

    @property
    def bound_layers(self) -> int:
        return self._handle.bound_layers

    @property
    def device_bytes(self) -> int:
        return self._handle.device_bytes

    @property
    def active(self) -> bool:
        return self._handle.active

    def set_weight(self, weight: float) -> None:
        """The weight of the next forwards (0: exact passthrough); also the step range's."""
        self.weight = float(weight)
        self._handle.set_weight(self.weight)

    def step(self, i: int, steps: int) -> float:
        """Sets the weight for step i of `steps` (see the class) and returns it."""
        if steps <= 0 or not 0 <= i < steps:
            raise InvalidArgument(f"LLLite step {i} of {steps}: want 0 <= i < steps")
        first, last = math.floor(self.begin * steps), math.ceil(self.end * steps)
        w = self.weight if first <= i <= last else 0.0
        self._handle.set_weight(w)
        return w

    def remove(self) -> None:
        self._handle.remove()

    def __enter__(self) -> "LLLite":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _qwen35_list(qwen35_hidden) -> Optional[list]:
    """The semantic connector's Qwen3.5 hidden states as the binding takes them: a list."""
    if qwen35_hidden is None:
        return None
    return [qwen35_hidden] if isinstance(qwen35_hidden, torch.Tensor) else list(qwen35_hidden)


class LockedModel:
    """A model in use: never evicted or unloaded while locked. Call it for the velocity."""

    def __init__(self, locked: _C.LockedModel):
        self._locked = locked

    def __call__(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
                 cross_attn_mask: Optional[torch.Tensor] = None,
                 mask_blocks: Optional[Union[str, Sequence[int]]] = None) -> torch.Tensor:
        return self.forward(x, timesteps, context, cross_attn_mask=cross_attn_mask, mask_blocks=mask_blocks)

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
                progress: Optional[Callable[[int, int], None]] = None,
                cross_attn_mask: Optional[torch.Tensor] = None,
                mask_blocks: Optional[Union[str, Sequence[int]]] = None) -> torch.Tensor:
        """The velocity; `progress(layers_done, layers_expected)` is called after each layer
        (`layers_expected` is the previous forward's layer count, 0 for the first). If it
        raises an Exception, sluice logs one warning and stops calling it for this forward; a
        KeyboardInterrupt (or SystemExit) raised in it stops the forward before its next layer
        and is raised again, as Ctrl-C during any forward on the main thread is.

        Regional prompting (README, "Regional prompting"): `cross_attn_mask`, a torch.bool
        tensor [L, S] or [B, L, S] (True: the image token attends to the context token; L =
        T' * ceil(H / 2) * ceil(W / 2) image tokens of x [B, C, T, H, W], S = context tokens),
        applies in the cross-attention of `mask_blocks`: block indices, or "even" (the
        default, as InvokeAI), "odd" or "all". A wrong dtype, shape or block index is a
        sluice.InvalidArgument (a ValueError) naming it."""
        return self._locked.forward(x, timesteps, context, progress, cross_attn_mask,
                                    self._mask_blocks(mask_blocks))

    def _mask_blocks(self, mask_blocks: Optional[Union[str, Sequence[int]]]) -> Optional[List[int]]:
        if mask_blocks is None or not isinstance(mask_blocks, str):
            return None if mask_blocks is None else [int(i) for i in mask_blocks]
        n = self.info["num_blocks"]
        if mask_blocks == "even":
            return list(range(0, n, 2))
        if mask_blocks == "odd":
            return list(range(1, n, 2))
        if mask_blocks == "all":
            return list(range(n))
        raise InvalidArgument(f"mask_blocks '{mask_blocks}' is not one of: even, odd, all, or a list of block indices")

    def encode_text(self, qwen_hidden: torch.Tensor, t5_ids: torch.Tensor,
                    t5_weights: Optional[torch.Tensor] = None, *,
                    qwen35_hidden: Optional[Union[torch.Tensor, Sequence[torch.Tensor]]] = None,
                    qwen35_mask: Optional[torch.Tensor] = None,
                    timesteps: Optional[torch.Tensor] = None) -> torch.Tensor:
        """LLM adapter: Qwen hidden states and T5 ids -> the DiT's cross-attention context.

        A model with a semantic connector (Anima-3.8B v1.1; info["connector"]["enabled"]) also
        takes the Qwen3.5 hidden states of its layers (qwen35_hidden: one [layers, B, S', W]
        tensor or a list of [B, S', W]), their mask [B, S'] (None: all valid) and the step's
        timesteps [B] (sigma); its output depends on the timestep, so encode again every step.
        Without them such a model runs its native adapter alone (logged once)."""
        return self._locked.encode_text(qwen_hidden, t5_ids, t5_weights, _qwen35_list(qwen35_hidden), qwen35_mask,
                                        timesteps)

    def locate_nonfinite(self, x: torch.Tensor, timesteps: torch.Tensor,
                         context: torch.Tensor, cross_attn_mask: Optional[torch.Tensor] = None,
                         mask_blocks: Optional[Union[str, Sequence[int]]] = None) -> Optional[dict]:
        """Runs the forward again with a check after every layer and block, for when a check
        of its output found a NaN or Inf: the first module whose output held one, as {"kind",
        "module", "nonfinite_values", "values", "output_nonfinite_values", "output_values",
        "forward_index"}, or None. Each layer then waits for the device; forwards never do.
        (Non-finite inputs are refused by every call: sluice.InvalidArgument names them.)
        cross_attn_mask and mask_blocks: as forward."""
        return self._locked.locate_nonfinite(x, timesteps, context, cross_attn_mask, self._mask_blocks(mask_blocks))

    def locate_nonfinite_text(self, qwen_hidden: torch.Tensor, t5_ids: torch.Tensor,
                              t5_weights: Optional[torch.Tensor] = None, *,
                              qwen35_hidden: Optional[Union[torch.Tensor, Sequence[torch.Tensor]]] = None,
                              qwen35_mask: Optional[torch.Tensor] = None,
                              timesteps: Optional[torch.Tensor] = None) -> Optional[dict]:
        """locate_nonfinite for encode_text, with the same inputs (the semantic connector's
        included, so that a connector layer can be the one named)."""
        return self._locked.locate_nonfinite_text(qwen_hidden, t5_ids, t5_weights, _qwen35_list(qwen35_hidden),
                                                  qwen35_mask, timesteps)

    def lora(self, path: str, scale: float = 1.0, block_layout: str = "measured") -> Lora:
        """Applies a LoRA file as a forward-time sidecar; use it as a context manager. It is
        removed at the latest when this lock is unlocked (see Lora). The model's device share
        grows by the sidecars' bytes from the cache's free budget; only what the budget cannot
        give streams more of its layers. sluice.ResourceError (one line naming the model, the
        LoRA and the bytes missing; nothing changed) when the budget cannot hold them at all.
        block_layout: "measured" sends the blocks of a LoRA trained on a shallower Anima (28
        blocks on a 40- or 52-block model, 40 on 52) to the blocks it was trained on, with one
        INFO log line; "as-is" applies them by index (anything else: sluice.InvalidArgument, a
        ValueError). A LoRA for a deeper model is a sluice.CheckpointError naming it."""
        return Lora(self._locked.apply_lora(path, scale, block_layout))

    def lllite(self, path: str, cond_image: Optional[torch.Tensor], weight: float = 1.0,
               mask: Optional[torch.Tensor] = None, block_layout: str = "measured",
               begin: float = 0.0, end: float = 1.0) -> LLLite:
        """Binds a ControlNet-LLLite file (v2 named-key format, as InvokeAI loads it) with its
        conditioning image: a float tensor [3, H, W] or [1, 3, H, W], RGB in [0, 1], any size
        (resized to the latent x 8, bicubic, as InvokeAI's prepare_cond_image); None binds it
        with no image (a passthrough). An inpaint adapter (4 input channels) needs `mask`
        ([H, W], [1, H, W] or [1, 1, H, W], 1 = inpaint); an RGB one takes none. Use it as a
        context manager (see LLLite, also for the step range `begin`/`end`). Its weights are
        charged like a LoRA's sidecars. Errors, one line each: sluice.FileError /
        sluice.CheckpointError naming the file and what does not fit; sluice.InvalidArgument
        (a ValueError) for a bad image, mask, weight or range. block_layout: as lora()."""
        if not (-10.0 <= weight <= 10.0):
            raise InvalidArgument(f"LLLite '{path}': weight {weight} is outside -10..10")
        if not (0.0 <= begin <= end <= 1.0):
            raise InvalidArgument(f"LLLite '{path}': begin {begin} and end {end} must satisfy 0 <= begin <= end <= 1")
        return LLLite(self._locked.apply_lllite(path, cond_image, float(weight), mask, block_layout),
                      float(weight), float(begin), float(end))

    @property
    def info(self) -> dict:
        return json.loads(self._locked.info_json())

    def unlock(self) -> None:
        """Ends the lock, first removing the LoRAs applied through it."""
        self._locked.unlock()

    def __enter__(self) -> "LockedModel":
        return self

    def __exit__(self, *exc) -> None:
        self.unlock()


class _Lock:
    """What Model.lock() returns: a context manager yielding a LockedModel (the lock is
    taken on entry, or at once when .acquire() is called)."""

    def __init__(self, model: _C.Model):
        self._model = model
        self._locked: Optional[LockedModel] = None

    def acquire(self) -> LockedModel:
        self._locked = LockedModel(self._model.lock())
        return self._locked

    def __enter__(self) -> LockedModel:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        if self._locked is not None:
            self._locked.unlock()
            self._locked = None


class Model:
    """A handle on a cached model."""

    def __init__(self, model: _C.Model):
        self._model = model

    @property
    def name(self) -> str:
        return self._model.name

    @property
    def info(self) -> dict:
        """The model's config (in_channels, crossattn_emb_channels, adapter dims, ...)."""
        return json.loads(self._model.info_json())

    def lock(self) -> _Lock:
        return _Lock(self._model)

    def stats(self) -> dict:
        """The --stats-json document: model, budget, device, forwards[], cache."""
        return json.loads(self._model.stats_json())

    def residency_map(self) -> str:
        return self._model.residency_map()

    def write_trace(self, path: str) -> None:
        self._model.write_trace(path)

    def partial_load(self, nbytes) -> int:
        """Makes about `nbytes` more of the model resident (an int, or a size string such as
        "512MiB"); returns the bytes it made resident."""
        return self._model.partial_load(size_bytes(nbytes, "nbytes", "partial_load"))

    def partial_unload(self, nbytes) -> int:
        """Gives back about `nbytes` of the model's device memory (an int, or a size string);
        returns the bytes given back."""
        return self._model.partial_unload(size_bytes(nbytes, "nbytes", "partial_unload"))

    def full_load(self) -> int:
        return self._model.full_load()

    def full_unload(self) -> int:
        return self._model.full_unload()

    def set_max_resident(self, fraction: Optional[float]) -> None:
        self._model.set_max_resident(fraction)


class ModelCache:
    """Models in RAM (fp8 storage by default) on one device under one VRAM budget.

    Keyword arguments are the fields of the C++ RuntimeOptions: device (a torch.device, a
    name such as "cuda", "cuda:1" or "cpu", which plays the device for tests, or an index of
    the current accelerator; default: sluice.default_device(), the current accelerator, "cpu"
    only when there is none), vram_budget ("50%" of total device memory, "6GiB", or "auto":
    free memory minus vram_headroom), vram_headroom, working_memory, resolution, ram_limit,
    prefetch ("auto" or a number of layers), pin_memory ("auto"|"on"|"off"),
    pin_memory_limit (page-locked bytes of all models, "25%" of RAM),
    policy ("balanced"|"spread"|"front-first"), timing, trace,
    device_memory, cpu_copy_gbps, load_threads (threads that read a checkpoint; 0: every core).
    Every size (vram_budget, vram_headroom, working_memory, ram_limit, pin_memory_limit,
    device_memory) is an int (bytes) or a size string; a bool, a float or a negative int is
    one InvalidArgument naming it.

    Torch modules a frontend already has go in with sluice.offload(module, cache=cache):
    they share the budget with the cache's other models, are listed in
    stats()["cache"]["models_held"], and are not among models() (their handle is the one
    offload() returned).
    """

    def __init__(self, device=None, vram_budget="", **options):
        _logging.sync_level()
        device = device_name(device, "ModelCache")
        vram_budget = size_text(vram_budget, "vram_budget", "ModelCache") or ""  # None, "": all of it
        for key in _SIZE_OPTIONS:
            if key in options:
                options[key] = size_text(options[key], key, "ModelCache") or ""  # None, "": the default
        if options.get("device_memory", 0) is None:
            del options["device_memory"]
        elif "device_memory" in options:
            options["device_memory"] = size_bytes(options["device_memory"], "device_memory", "ModelCache")
        self._cache = _C.ModelCache(_C.RuntimeOptions(device=device, vram_budget=vram_budget, **options))
        self._device = device  # sluice.offload(module, cache=self) checks the module's tensors against it

    @property
    def device(self) -> str:
        """The device the cache runs on, as sluice names it ("cuda", "cuda:1", "cpu")."""
        return self._device

    def load(self, path_or_preset: str, storage="float8_e4m3fn", compute="auto",
             extra_skips: Iterable[str] = (), use_default_skips: bool = True, use_model_skips: bool = True,
             max_resident: Optional[float] = None, config: str = "", seed: int = 0, name: str = "") -> Model:
        """A checkpoint (.safetensors), a preset name ("anima-small", generated from `seed`) or a JSON config.

        storage: the stored dtype of the Linear/Embedding weights (a torch.dtype or its name).
        compute: "auto" (bfloat16 where the device computes it natively, else float32; the
        choice and its reason are in stats()["model"]["compute"]), or a torch.dtype or its
        name: bfloat16, float16 or float32."""
        storage = dtype_name(storage, "storage", "load")
        compute = dtype_name(compute, "compute", "load")
        if storage is None or compute is None:
            raise InvalidArgument("load: storage= and compute= take a torch.dtype or its name, not None")
        opts = _C.LoadOptions(storage=storage, compute=compute, extra_skips=list(extra_skips),
                              use_default_skips=use_default_skips, use_model_skips=use_model_skips,
                              max_resident=max_resident, config=config, seed=seed, name=name)
        return Model(self._cache.load(str(path_or_preset), opts))

    def drop(self, model: Model) -> None:
        self._cache.drop(model._model)

    def set_vram_budget(self, budget) -> None:
        """A new budget for the whole cache: an int (bytes) or a size string ("6GiB", "50%", "auto")."""
        self._cache.set_vram_budget(size_text(budget, "budget", "set_vram_budget"))

    def models(self) -> List[Model]:
        """Handles on every model the cache holds (also those whose handles were dropped, and
        dropped models still locked), in load order. Names may repeat; stats()["model"]["id"]
        tells models apart."""
        return [Model(m) for m in self._cache.models()]

    def stats(self) -> dict:
        """{"cache": the counters of --stats-json's "cache" object (hits, misses, loads,
        evictions, ram, vram ..., models_held), "models": [the --stats-json document of each
        model the cache holds, in load order]}. Models are a list, not keyed by name: two
        models may share a name; each document's "model" has its "id" and "source".

        Every device total is the sum of its parts, or a named field holds the remainder:
        cache["vram"]["current"] == cache["models_allocated_bytes"] +
        cache["vram_unattributed_bytes"] (ring slots no model holds; 0 between forwards), where
        models_allocated_bytes is the sum of the models' device["allocated_bytes"] (their
        device["current_bytes"] counts a staging ring at its capacity); and a model's
        device["allocator_current_bytes"] (the whole device) == its device["allocated_bytes"] +
        device["other_models_bytes"] + device["unattributed_bytes"] (activations, outputs and
        other tensors no model holds; None where the allocator has no counters)."""
        return {"cache": json.loads(self._cache.stats_json()),
                "models": [m.stats() for m in self.models()]}


Runtime = ModelCache
# ModelCache's size options besides vram_budget, given to the C++ options as text.
_SIZE_OPTIONS = ("vram_headroom", "working_memory", "ram_limit", "pin_memory_limit")


def inspect(path_or_preset: str, storage="") -> dict:
    """What `sluice inspect --json` prints for a checkpoint (or, for a preset name, its
    shape-only build): tensors, parameters, bytes by dtype, groups, config, param_size_mib.
    storage: a torch.dtype or its name ("" : the checkpoint's own)."""
    return json.loads(_C.inspect_json(str(path_or_preset), dtype_name(storage, "storage", "inspect") or ""))
