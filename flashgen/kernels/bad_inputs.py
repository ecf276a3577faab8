"""The error word through which the serving kernels report a bad index input without a host sync.

A serving kernel checks each sequence's index inputs against the bounds its launcher packs (page ids against the
cache's pages, cache_seqlens against its capacity, cu_seqlens_q/_k against the packed lengths). A sequence that
fails reads and writes nothing outside the buffers: its output rows and LSE become NaN, and thread 0 of its
blocks records (code << 32) | sequence in a 64-bit word, only while the word is 0 (the first bad input wins).
The word lives in pinned host memory mapped into the device (one per device, allocated on first use), so the
host reads it with a plain memory read: `check_errors()`, which each serving call runs first, raises a
ValueError naming the input and the sequence and resets the word. CUDA graphs replay with the same word (its
pointer is in the captured parameters); call `flashgen.check_errors()` after a replay.
"""
from __future__ import annotations

import ctypes
import threading

from .. import abi, driver

_words: dict[int, tuple[ctypes.c_uint64, int]] = {}  # device -> (the word, read from the host; its device address)
_lock = threading.Lock()

# What each input's bound is, for the message.
_BOUNDS = {
    "block_table": "a page id outside [0, num_pages) of the paged cache",
    "cache_seqlens": "a length below 0 or past the cache's capacity (max_pages * page_size for a paged cache)",
    "cu_seqlens_q": "offsets that decrease or fall outside [0, total_q] (the packed q's rows), or a sequence "
                    "longer than max_seqlen_q (rows past it are not computed)",
    "cu_seqlens_k": "offsets that decrease or fall outside [0, total_k] (the packed k's rows)",
}


def error_word(device: int) -> int:
    """The device address of `device`'s error word, which the serving launchers pack into ServeParams.error."""
    word = _words.get(device)
    if word is None:
        with _lock:
            word = _words.get(device)
            if word is None:
                host, dev = driver.host_mapped(device, ctypes.sizeof(ctypes.c_uint64))
                word = _words[device] = (ctypes.c_uint64.from_address(host), dev)
    return word[1]


def describe(device: int, value: int) -> str:
    """The message of an error word's `value` (nonzero) recorded on `device`."""
    code, seq = value >> 32, value & 0xFFFFFFFF
    name = abi.SERVE_INPUTS[code - 1] if 1 <= code <= len(abi.SERVE_INPUTS) else f"an index input (code {code})"
    return (f"{name} of sequence {seq} is out of bounds ({_BOUNDS.get(name, 'outside its bounds')}): a serving "
            f"kernel on cuda:{device} found it in a call since the last check, read nothing outside the buffers and "
            f"wrote NaN to that sequence's output rows and LSE; the other sequences' results are correct")


def check_errors() -> None:
    """Raise ValueError if a serving kernel recorded a bad input since the last check (on any device this process
    launched serving kernels on), resetting the word. A plain host read of mapped memory: no sync, so a kernel
    still running may report at the next check."""
    for device, (word, _) in list(_words.items()):
        value = word.value
        if value:
            word.value = 0
            raise ValueError(describe(device, value))


__all__ = ["check_errors", "describe", "error_word"]
