"""sluice's log lines in Python's logging, as the `sluice` logger (Note [log sink] in
python/src/sluice_python.cpp): configure it as any library's,

    logging.getLogger("sluice").setLevel(logging.DEBUG)   # at any time

and the next calls into sluice log at that level (the engine is told the level at each
offload(), each offloaded forward and each ModelCache made). SLUICE_LOG_LEVEL, when set,
is the logger's level until the program sets one.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time

from . import _C

log = logging.getLogger("sluice")
TRACE = 5  # below DEBUG: the engine's per-layer lines
# sluice::LogLevel's order: trace, debug, info, warn, error, off.
_TO_PY = {0: TRACE, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_FROM_ENV = {"trace": TRACE, "debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
             "warning": logging.WARNING, "error": logging.ERROR, "off": logging.CRITICAL + 10}
_level = None  # the level the engine was last told


def sync_level() -> None:
    """Tells the engine the `sluice` logger's effective level (when it changed)."""
    global _level
    py = log.getEffectiveLevel()
    level = 0 if py <= TRACE else 1 if py <= logging.DEBUG else 2 if py <= logging.INFO else \
        3 if py <= logging.WARNING else 4 if py <= logging.ERROR else 5
    if level != _level:
        _C._set_log_level(level)
        _level = level


def _emit(line) -> None:
    level, message = line
    log.log(_TO_PY.get(level, logging.ERROR), message)


def flush() -> None:
    """The queued lines into the logger now (offloaded forwards call it at their end)."""
    while True:
        line = _C._log_next()
        if line is None:
            return
        _emit(line)


def _pump() -> None:
    while True:
        flush()
        time.sleep(0.1)  # in Python, not in sluice: see Note [log sink]


def start() -> None:
    env = os.environ.get("SLUICE_LOG_LEVEL", "").strip().lower()
    if env in _FROM_ENV and log.level == logging.NOTSET:
        log.setLevel(_FROM_ENV[env])
    _C._log_to_queue(True)
    sync_level()
    threading.Thread(target=_pump, name="sluice-log", daemon=True).start()
    atexit.register(flush)
