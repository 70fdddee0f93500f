"""Time-to-ready of one checkpoint in one Python process, page cache warm (issue 14's table).

    PYTHONPATH=build/pyinstall .venv/bin/python bench/load_compare.py FILE.safetensors STORAGE [REPS]

Prints, for each of REPS runs (seconds):
  raw read               read() of the whole file into a reused 16 MiB buffer (like cat)
  safetensors+torch      safetensors.torch.load_file, then .to(float8_e4m3fn) per 2-d
                         ".weight" (when STORAGE is fp8) and .clone() of the rest: what a
                         Python frontend does
  sluice ModelCache.load sluice.ModelCache(device="cpu").load(FILE, storage=STORAGE); with
                         SLUICE_LOG_LEVEL=info the log lines split it into the host load
                         (read and cast) and the attach to the device.
"""
import os
import sys
import time

import safetensors.torch as sft
import torch

import sluice

path, storage = sys.argv[1], sys.argv[2]
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 2
size = os.path.getsize(path)


def raw():
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass


def python_path():
    out = {}
    for k, v in sft.load_file(path).items():
        if storage.startswith("float8") and v.dim() == 2 and k.endswith(".weight") and v.element_size() > 1:
            out[k] = v.to(torch.float8_e4m3fn)
        else:
            out[k] = v.clone()
    return out


def sluice_load():
    cache = sluice.ModelCache(device="cpu")
    model = cache.load(path, storage=storage)
    del model, cache


raw()  # warm the page cache
for name, fn in (("raw read", raw), ("safetensors+torch", python_path), ("sluice ModelCache.load", sluice_load)):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
        del result
    print(f"{name:24s} " + " ".join(f"{t:.2f}" for t in times) +
          f" s ({size / 1e9:.2f} GB file, best {size / min(times) / 1e9:.2f} GB/s)", flush=True)
