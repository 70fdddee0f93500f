#!/usr/bin/env python3
"""Checks that the tree's cross-references resolve (issue 39), in ctest:

- every `Note [x]` cited is defined exactly once. A definition is a line ending in
  `Note [x]` (in a C++ `//` comment, a Python or shell `#` comment, or a docstring) with a
  `~~~~` underline on the line below; every other mention is a citation;
- a citation that says where a note lives (`Note [x] in file.h`, `Note [x] (file.h)`) names
  the file that defines it;
- a comment naming a source file (`offload/device/device.h`, `cpu_device.h`) names one that
  exists: a path from the root, from the citing file's folder, under include/ or python/, or
  a bare name that some file of the tree has. Names of other projects' files (torch, c10,
  diffusers, InvokeAI, ...) are listed below;
- a public header (include/sluice/) cites only public headers, notes defined in them, and
  README sections;
- offload/'s folders include one way (offload/README.md): a folder includes nothing from a
  folder above it.
- no Catch2 test case under tests/ has a `;` in its name: catch_discover_tests splits a name
  at `;` into several ctest entries, each of which matches no case and passes having run
  nothing.

Usage: scripts/check_tree.py [ROOT]   (default: the checkout holding this script). Exits 1
and prints one line per fault, or prints a summary line and exits 0.
"""
import os
import re
import subprocess
import sys

# This script and its test name notes and files as examples.
SELF = {"scripts/check_tree.py", "tests/cmake/check_tree_faults.sh"}
SOURCE_EXT = (".h", ".hpp", ".cpp", ".cc", ".cu", ".c", ".py", ".sh", ".cmake")
CITED_EXT = r"(?:h|hpp|cpp|cu|c|py|sh|cmake|md|toml|in)"
# Files of other projects that comments cite (paths and bare names).
EXTERNAL_PREFIXES = ("c10/", "ATen/", "torch/", "aten/", "caffe2/", "pybind11/", "diffusers/", "invokeai/",
                     "comfy/", "nlohmann/", "spdlog/", "fmt/", "catch2/", "benchmark/", "cuda/", "hip/",
                     "mimalloc", "backend/", "src/diffusers/", "models/transformers/", "torch-", "sys/",
                     "linux/", "bits/", "comfy_extras/", "invokeai/backend/", "/proc/", "/sys/", "/usr/",
                     "/dev/", "../", ".deps/", "OUT/", "$OUT/")
EXTERNAL_NAMES = {
    # torch / c10 / ATen
    "CachingDeviceAllocator.h", "Allocator.h", "DeviceGuardImplInterface.h", "CUDACachingAllocator.h",
    "CUDACachingAllocator.cpp", "Copy.cpp", "cpuinfo.h", "TensorImpl.h", "Stream.h", "Event.h",
    "__init__.py", "_tensor.py", "module.py", "hooks.py", "linear.py", "sparse.py", "conv.py",
    "cpp_extension.py", "ATen.h", "torch.h", "extension.h", "python.h", "Python.h", "library.h",
    "CachingHostAllocator.h", "DeviceAllocator.h", "HostAllocator.h", "AcceleratorHooksInterface.h",
    "PrivateUse1HooksInterface.h", "Utils.cpp", "pinned_memory.py", "_utils.py", "graph.py",
    "eval_frame.py", "cuda_runtime.h", "cuda_runtime_api.h", "hip_runtime.h", "cuda_fp8.h",
    # diffusers / transformers / InvokeAI / ComfyUI / peers
    "transformer_cosmos.py", "pipeline_anima.py", "group_offloading.py", "layerwise_casting.py",
    "anima_transformer.py", "anima_transformer_patch.py", "control_net_lllite.py", "model_patcher.py",
    "modeling_utils.py", "model_management.py", "torch_module_autocast.py", "model_cache.py",
    "autocast_modules.py", "cached_model_with_partial_load.py", "model.py", "ops.py", "lora.py",
    "memory_management.py", "offload.py", "hooks.cpp", "ggml.h", "ggml.c", "stable-diffusion.cpp",
    "safetensors.py", "modeling_qwen3.py", "configuration_utils.py", "pipeline_utils.py",
    # system and tools
    "malloc.h", "unistd.h", "mman.h", "dlfcn.h", "memory.max", "meminfo", "pyproject.toml",
    "setup.py", "conftest.py", "CMakeLists.txt", "sluiceConfig.cmake", "catch.hpp", "json.hpp",
    "CatchAddTests.cmake",
    # what bench/gpu/device_all.sh writes into its output folder
    "compare.md", "offload.md", "compiled.md",
}

OTHER_PROJECT = re.compile(r"\b(diffusers|InvokeAI|invokeai|ComfyUI|transformers|llama\.cpp|PyTorch|torch's|"
                           r"stable-diffusion\.cpp|mmgp|wheel)\b")
NOTE_REF = re.compile(r"Note \[([^\]\n]+)\]")
# "Note [x] in file.h", "Note [x] (file.h...": the citation names where the note lives.
NOTE_WHERE = re.compile(r"Note \[([^\]\n]+)\](?: in |,? \(|: )`?((?:[\w.+-]+/)*[\w+-]+\.(?:h|hpp|cpp|cu|py|sh|cmake))\b")
NOTE_DEF = re.compile(r"Note \[([^\]\n]+)\]\s*$")
UNDERLINE = re.compile(r"^\s*(?://+|#+|\*)?\s*~{4,}\s*$")
FILE_CITE = re.compile(r"(?<![\w./-])((?:[\w.+-]+/)*[\w+-]+(?:\.[\w+-]+)*\." + CITED_EXT + r")(?![\w/])")


def tracked_files(root):
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=root, check=True,
                         capture_output=True, text=True).stdout.split("\n")
    return [f for f in out if f and os.path.isfile(os.path.join(root, f))]


def comment_text(path, line):
    """The part of a source line that is comment (a docstring line counts as a whole)."""
    if path.endswith((".py", ".sh", ".cmake")) or os.path.basename(path) == "CMakeLists.txt":
        i = line.find("#")
        return line[i + 1:] if i >= 0 else None
    stripped = line.lstrip()
    if stripped.startswith(("/*", "*")):
        return stripped.lstrip("/*")
    i = line.find("//")
    while i > 0 and line[i - 1] == ":":  # a URL
        i = line.find("//", i + 2)
    return line[i + 2:] if i >= 0 else None


def python_docstring_lines(lines):
    """Indices of lines inside triple-quoted strings (docstrings) of a Python file."""
    inside, quote, out = False, None, set()
    for i, line in enumerate(lines):
        if inside:
            out.add(i)
            if quote in line:
                inside = False
            continue
        for q in ('"""', "'''"):
            if q in line:
                if line.count(q) % 2 == 1:
                    inside, quote = True, q
                out.add(i)
                break
    return out


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    files = tracked_files(root)
    existing = set(files)
    basenames = {os.path.basename(f) for f in files}
    sources = [f for f in files if (f.endswith(SOURCE_EXT) or os.path.basename(f) == "CMakeLists.txt")
               and f not in SELF]
    public = [f for f in sources if f.startswith("include/sluice/")]
    faults = []

    defs, refs, placed = {}, {}, []
    for f in sources:
        with open(os.path.join(root, f), encoding="utf-8", errors="replace") as fh:
            lines = fh.read().split("\n")
        doc = python_docstring_lines(lines) if f.endswith(".py") else set()
        for n, line in enumerate(lines, 1):
            m = NOTE_DEF.search(line)
            if m and n < len(lines) and UNDERLINE.match(lines[n]):
                defs.setdefault(m.group(1), []).append((f, n))
                continue
            for r in NOTE_REF.finditer(line):
                refs.setdefault(r.group(1), []).append((f, n))
            for w in NOTE_WHERE.finditer(line):
                placed.append((f, n, w.group(1), w.group(2)))
            text = comment_text(f, line)
            if text is None and (n - 1) in doc:
                text = line
            if text is None:
                continue
            for c in FILE_CITE.finditer(text):
                cited = c.group(1).rstrip(".")
                # A comment naming another project (on its line, or above a list) names that
                # project's files.
                if not cited_exists(f, cited, existing, basenames) and \
                        not OTHER_PROJECT.search(" ".join(lines[max(0, n - 10):n])):
                    faults.append(f"{f}:{n}: names {cited}, which is no file of the tree")
                elif f in public and not public_cite_ok(cited):
                    faults.append(f"{f}:{n}: a public header cites {cited}, which is no public header "
                                  "(cite a public header or a README section)")
    for name, where in sorted(defs.items()):
        if len(where) > 1:
            faults.append(f"Note [{name}] is defined {len(where)} times: " +
                          ", ".join(f"{f}:{n}" for f, n in where))
    for name, where in sorted(refs.items()):
        if name not in defs:
            f, n = where[0]
            more = f" (and {len(where) - 1} more)" if len(where) > 1 else ""
            faults.append(f"{f}:{n}: Note [{name}] is defined nowhere{more}")
        for f, n in where:
            if f in public and name in defs and not all(d.startswith("include/sluice/") for d, _ in defs[name]):
                faults.append(f"{f}:{n}: a public header cites Note [{name}], defined in "
                              f"{defs[name][0][0]}, which is no public header")
    for f, n, name, where in placed:
        if name in defs and not any(d == where or d.endswith("/" + where) for d, _ in defs[name]):
            faults.append(f"{f}:{n}: cites Note [{name}] in {where}, but it is defined in {defs[name][0][0]}")
    faults += layering(root, files)
    faults += test_case_names(root, files)
    for line in faults:
        print(line)
    if faults:
        print(f"check_tree: {len(faults)} fault(s)")
        return 1
    print(f"check_tree: {len(defs)} notes defined once each, {sum(len(v) for v in refs.values())} citations "
          f"resolve; every file named in a comment exists; offload/ includes run one way")
    return 0


# TEST_CASE( followed by its name: one string literal or several adjacent ones.
TEST_CASE_NAME = re.compile(r'\bTEST_CASE\(\s*((?:"(?:[^"\\\n]|\\.)*"\s*)+)')


def test_case_names(root, files):
    """A Catch2 case whose name holds ';' never runs under ctest (catch_discover_tests splits
    the name into several entries, each filtering on a fragment that matches no case)."""
    faults = []
    for f in files:
        if not (f.startswith("tests/") and f.endswith(".cpp")):
            continue
        with open(os.path.join(root, f), encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        for m in TEST_CASE_NAME.finditer(text):
            name = "".join(re.findall(r'"((?:[^"\\\n]|\\.)*)"', m.group(1)))
            if ";" in name:
                n = text.count("\n", 0, m.start()) + 1
                faults.append(f"{f}:{n}: test case name has ';' ({name!r}): ctest would split it into entries "
                              "that run nothing; use ',' instead")
    return faults


def cited_exists(citer, cited, existing, basenames):
    if cited.startswith(EXTERNAL_PREFIXES) or cited in EXTERNAL_NAMES:
        return True
    if "/" not in cited:
        return cited in basenames
    here = os.path.dirname(citer)
    return any(cand in existing for cand in (cited, os.path.normpath(os.path.join(here, cited)),
                                             "include/" + cited, "python/" + cited, "tests/" + cited))


def public_cite_ok(cited):
    return cited.startswith(("sluice/", "include/sluice/")) or cited == "README.md" or \
        cited in ("sluice.hpp", "inspect.hpp", "offload.hpp", "sluice.h")


# offload/'s folders and what each may include (offload/README.md).
LAYERS = {
    "device": set(),
    "layer": set(),
    "plan": set(),
    "report": {"device"},
    "engine": {"device", "layer", "plan", "report"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"offload/([a-z_]+)/')


def layering(root, files):
    faults = []
    for f in files:
        parts = f.split("/")
        if len(parts) < 3 or parts[0] != "offload" or parts[1] not in LAYERS:
            if len(parts) == 2 and parts[0] == "offload" and f.endswith((".h", ".cpp")):
                faults.append(f"{f}: a source file directly in offload/ (each belongs to one of its folders)")
            continue
        folder = parts[1]
        with open(os.path.join(root, f), encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                m = INCLUDE.match(line)
                if m and m.group(1) != folder and m.group(1) not in LAYERS[folder]:
                    faults.append(f"{f}:{n}: offload/{folder}/ includes offload/{m.group(1)}/, a folder above it")
    return faults


if __name__ == "__main__":
    sys.exit(main())
