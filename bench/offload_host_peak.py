#!/usr/bin/env python3
"""Host memory of sluice.offload(module) at each stage, on a module of 16 Linear(2048, 2048)
layers in bf16 (128 MiB), every layer streamed (max_resident=0.0), on the CPU device: the
peak RSS of offload() and of remove() (each reset just before it, through
/proc/self/clear_refs) and the RSS at rest, each over the process's RSS before the module
was built, as a multiple of the module's bytes. Issue 37's target for both peaks: 1.1x the
module plus one layer's stored copy (1.1625x here, 1.13x for fp8). No forward runs in
between: what offload() and remove() themselves hold (bench/offload_vs_diffusers.py
measures the stages around forwards, on a diffusers transformer). On the CPU device the
device is host memory too: the staging ring sluice makes at attach is in these peaks.
Linux only.

    PYTHONPATH=build/pyinstall .venv/bin/python bench/offload_host_peak.py    # both storages, pin off and on

Each case runs in a fresh process (its own base).
"""
import ctypes
import subprocess
import sys
import time


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise SystemExit(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def one(storage: str, pin: str) -> str:
    import torch

    import sluice

    torch.set_num_threads(1)
    ctypes.CDLL(None).malloc_trim(0)
    base = status("VmRSS")
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False, dtype=torch.bfloat16) for _ in range(16)])
    size = sum(p.numel() * p.element_size() for p in m.parameters())
    reset_peak()
    t0 = time.perf_counter()
    h = sluice.offload(m, device="cpu", storage=storage, max_resident=0.0, pin_memory=pin)
    t_off = time.perf_counter() - t0
    peak_off = status("VmHWM") - base
    rest = status("VmRSS") - base
    reset_peak()
    t0 = time.perf_counter()
    h.remove()
    t_rm = time.perf_counter() - t0
    peak_rm = status("VmHWM") - base
    after = status("VmRSS") - base
    r = lambda b: f"{b / size:.2f}x"  # noqa: E731
    return (f"| {storage} | {pin} | {r(peak_off)} | {r(rest)} | {r(peak_rm)} | {r(after)} | "
            f"{t_off * 1e3:.0f} / {t_rm * 1e3:.0f} |")


def main() -> int:
    if len(sys.argv) == 3:
        print(one(sys.argv[1], sys.argv[2]))
        return 0
    print("module: 16 x Linear(2048, 2048) bf16, 128 MiB; every layer streamed; CPU device")
    print("| storage | pin_memory | offload() peak | at rest | remove() peak | after remove() | offload / remove ms |")
    print("|---|---|---|---|---|---|---|")
    for storage in ("bfloat16", "float8_e4m3fn"):
        for pin in ("off", "on"):
            out = subprocess.run([sys.executable, __file__, storage, pin], capture_output=True, text=True, check=True)
            print(out.stdout.strip().splitlines()[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
