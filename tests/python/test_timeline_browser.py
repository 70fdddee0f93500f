#!/usr/bin/env python3
"""`sluice run --timeline` in a real browser: headless Chromium draws the SVG.

    test_timeline_browser.py --sluice build/cli/sluice --workdir build/tests/python/timeline_browser

Runs a small model with --timeline, checks the SVG parses as XML (xml.etree), screenshots
it with headless Chromium and checks the pixels: the picture is not blank (many colours,
enough non-white pixels), the compute lane's rows hold both the resident and the streamed
fill, and the copy lane's rows the streamed fill (lane rows are read from the SVG's
lane-* groups: data-y, data-height). As a control the same checks must reject a blank SVG
of the same size, screenshot the same way, so they cannot pass vacuously. The PNG is
decoded with zlib here (no imaging package needed).

Chromium is required (scripts/setup.sh installs Debian's `chromium`): without it this
fails (exit 1); it never skips. Exit 0 when every check passes, 1 otherwise, 2 for a
broken setup.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import struct
import xml.etree.ElementTree as ET
import zlib

# The renderer's fills (offload/report/timeline_svg.cpp: kResident, kStreamed).
RESIDENT = (0x5B, 0x8F, 0xD0)
STREAMED = (0xF5, 0x85, 0x18)
SVG_NS = "{http://www.w3.org/2000/svg}"


def find_chromium(explicit):
    for name in [explicit] if explicit else ["chromium", "chromium-browser", "google-chrome"]:
        path = shutil.which(name) if name else None
        if path:
            return path
    return None


def screenshot(chromium, svg_path, png_path, width, height, timeout):
    """Chromium's new headless mode: --screenshot writes the page at --window-size."""
    with tempfile.TemporaryDirectory(prefix="sluice-chromium-") as profile:
        cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars",
               "--force-device-scale-factor=1", "--user-data-dir=" + profile,
               "--screenshot=" + png_path, "--window-size=%d,%d" % (width, height),
               "file://" + os.path.abspath(svg_path)]
        if os.path.exists(png_path):
            os.unlink(png_path)
        try:
            r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, text=True)
        except subprocess.TimeoutExpired:
            raise SystemExit("FAIL: chromium did not finish in %d s: %s" % (timeout, " ".join(cmd)))
        if r.returncode != 0 or not os.path.exists(png_path):
            raise SystemExit("FAIL: chromium exited %d without a screenshot:\n%s\n%s" %
                             (r.returncode, " ".join(cmd), r.stdout[-3000:]))


class Png:
    """An 8-bit RGB or RGBA, non-interlaced PNG (what Chromium's --screenshot writes), decoded
    with zlib alone; px[x, y] is an (r, g, b) tuple."""

    def __init__(self, path):
        with open(path, "rb") as f:
            data = f.read()
        if data[:8] != b"\x89PNG\r\n\x1a\n":
            raise SystemExit("FAIL: %s is not a PNG" % path)
        pos, idat, header = 8, [], None
        while pos < len(data):
            (length,) = struct.unpack(">I", data[pos:pos + 4])
            kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
            pos += 12 + length
            if kind == b"IHDR":
                header = struct.unpack(">IIBBBBB", body)
            elif kind == b"IDAT":
                idat.append(body)
            elif kind == b"IEND":
                break
        w, h, depth, colour, _, _, interlace = header
        if depth != 8 or colour not in (2, 6) or interlace != 0:
            raise SystemExit("FAIL: %s: PNG depth %d colour type %d interlace %d not supported" %
                             (path, depth, colour, interlace))
        bpp = 3 if colour == 2 else 4
        raw = zlib.decompress(b"".join(idat))
        stride = w * bpp
        rows, prev = [], bytearray(stride)
        for y in range(h):
            ftype = raw[y * (stride + 1)]
            line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
            if ftype == 1:
                for i in range(bpp, stride):
                    line[i] = (line[i] + line[i - bpp]) & 0xFF
            elif ftype == 2:
                for i in range(stride):
                    line[i] = (line[i] + prev[i]) & 0xFF
            elif ftype == 3:
                for i in range(stride):
                    left = line[i - bpp] if i >= bpp else 0
                    line[i] = (line[i] + ((left + prev[i]) >> 1)) & 0xFF
            elif ftype == 4:
                for i in range(stride):
                    a = line[i - bpp] if i >= bpp else 0
                    b = prev[i]
                    c = prev[i - bpp] if i >= bpp else 0
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    pred = a if (pa <= pb and pa <= pc) else (b if pb <= pc else c)
                    line[i] = (line[i] + pred) & 0xFF
            elif ftype != 0:
                raise SystemExit("FAIL: %s: bad PNG filter %d" % (path, ftype))
            rows.append(bytes(line))
            prev = line
        self.size = (w, h)
        self._rows, self._bpp = rows, bpp

    def __getitem__(self, xy):
        x, y = xy
        r = self._rows[y]
        i = x * self._bpp
        return (r[i], r[i + 1], r[i + 2])


def near(p, c, tol=6):
    return abs(p[0] - c[0]) <= tol and abs(p[1] - c[1]) <= tol and abs(p[2] - c[2]) <= tol


def lane_rows(root):
    """lane name -> (top, bottom) in SVG user units, from <g id="lane-*" data-y data-height>."""
    rows = {}
    for g in root.iter(SVG_NS + "g"):
        gid = g.get("id", "")
        if gid.startswith("lane-"):
            y, h = float(g.get("data-y")), float(g.get("data-height"))
            rows[gid[len("lane-"):]] = (y, y + h)
    return rows


def check_pixels(png_path, rows, label):
    """The list of failed checks (empty: it passed)."""
    px = Png(png_path)
    w, h = px.size
    failures = []
    colours = set()
    non_white = 0
    for y in range(0, h, 2):
        for x in range(0, w, 2):
            p = px[x, y]
            colours.add(p)
            if p[0] < 235 or p[1] < 235 or p[2] < 235:
                non_white += 1
    frac = non_white / float(((w + 1) // 2) * ((h + 1) // 2))
    print("%s: %dx%d px, %d distinct colours, %.1f%% non-white" % (label, w, h, len(colours), 100 * frac))
    if len(colours) < 20:
        failures.append("%s: only %d distinct colours (blank?)" % (label, len(colours)))
    if frac < 0.05:
        failures.append("%s: only %.1f%% of pixels are not white (blank?)" % (label, 100 * frac))

    def count(lane, colour):
        top, bottom = rows[lane]
        n = 0
        for y in range(int(top) + 3, min(int(bottom) - 2, h)):
            for x in range(w):
                if near(px[x, y], colour):
                    n += 1
        return n

    for lane, colour, name in [("compute", RESIDENT, "resident"), ("compute", STREAMED, "streamed"),
                               ("copy", STREAMED, "streamed")]:
        n = count(lane, colour)
        print("%s: %s lane rows: %d pixels of the %s fill" % (label, lane, n, name))
        if n < 200:
            failures.append("%s: the %s lane's rows have %d pixels of the %s fill (want >= 200)" %
                            (label, lane, n, name))
    # The streamed fill belongs to the lanes: none in the title and caption rows above them.
    top_lane = min(t for t, _ in rows.values())
    stray = sum(1 for y in range(0, int(top_lane) - 20) for x in range(w) if near(px[x, y], STREAMED))
    if stray > 0:
        failures.append("%s: %d streamed-fill pixels above the lanes" % (label, stray))
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sluice", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--chromium", default=None, help="browser binary (default: chromium from PATH)")
    ap.add_argument("--timeout", type=int, default=120)
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    chromium = find_chromium(args.chromium)
    if chromium is None:
        print("FAIL: no chromium on PATH (scripts/setup.sh installs Debian's chromium)")
        return 1

    svg = os.path.join(args.workdir, "t.svg")
    cmd = [args.sluice, "run", "--synthetic", "anima-small", "--device", "cpu", "--max-resident", "0.5", "--steps",
           "3", "--resolution", "64", "--timeline", svg]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    if r.returncode != 0 or ("wrote " + svg) not in r.stdout:
        print("FAIL: %s exited %d\n%s\n%s" % (" ".join(cmd), r.returncode, r.stdout, r.stderr))
        return 1
    try:
        root = ET.parse(svg).getroot()
    except ET.ParseError as e:
        print("FAIL: %s is not well-formed XML: %s" % (svg, e))
        return 1
    if root.tag != SVG_NS + "svg":
        print("FAIL: the root element is %s, not an SVG" % root.tag)
        return 1
    width, height = int(float(root.get("width"))), int(float(root.get("height")))
    rows = lane_rows(root)
    if set(rows) != {"copy", "upcast", "compute"}:
        print("FAIL: lanes %s, expected copy, upcast and compute" % sorted(rows))
        return 1
    for bad in ("script", "image", "foreignObject"):
        if list(root.iter(SVG_NS + bad)):
            print("FAIL: the SVG has a <%s> element (it must be self-contained)" % bad)
            return 1

    shot = os.path.join(args.workdir, "shot.png")
    screenshot(chromium, svg, shot, width, height, args.timeout)
    failures = check_pixels(shot, rows, "timeline")

    # The control: a blank SVG of the same size must fail the same checks.
    blank = os.path.join(args.workdir, "blank.svg")
    with open(blank, "w") as f:
        f.write('<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d"/>\n' % (width, height))
    blank_shot = os.path.join(args.workdir, "blank.png")
    screenshot(chromium, blank, blank_shot, width, height, args.timeout)
    if not check_pixels(blank_shot, rows, "blank control"):
        failures.append("the checks passed on a blank SVG: they prove nothing")

    if failures:
        print("FAIL:\n  " + "\n  ".join(failures))
        return 1
    print("PASS: %s renders in %s (screenshot %s)" % (svg, chromium, shot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
