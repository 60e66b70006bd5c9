"""Read another process's memory directly: Linux ``process_vm_readv`` (cross-memory attach).

Why: to sum gradients through a shared segment, every rank first copies each gradient
autograd produced into the segment, so that peers can see it. On a 2-core box that copy
(33.6 MB of an 8.4M-parameter model: read the gradient, read-for-ownership and write the
segment) cost about as much as the sum itself. The kernel can instead copy straight from
a peer's private pages into ours, so a rank reads exactly the bytes it needs, once, into
a buffer small enough to stay in cache (the same mechanism MPI libraries call CMA).

Permission: the kernel allows it between processes of the same user unless a security
module forbids it (Yama ``ptrace_scope`` >= 1 allows only descendants, containers may
filter the syscall). :func:`probe_token` lets ranks test it on each other once; callers
fall back to the shared-segment path when any pair fails. ``$DDPKIT_PEER_READ=0``
turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Sequence

ENV = "DDPKIT_PEER_READ"
# The kernel refuses more iovecs per call than this (UIO_MAXIOV).
MAX_IOV = 1024


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_readv = None


def _function():
    global _readv
    if _readv is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.process_vm_readv
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                       ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
        _readv = fn
    return _readv


def enabled() -> bool:
    """Whether this platform has the call and the user did not turn it off."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        _function()
    except (OSError, AttributeError):
        return False
    return True


def _iovecs(spans: Sequence[tuple[int, int]]):
    array = (_Iovec * len(spans))()
    for slot, (addr, nbytes) in zip(array, spans):
        slot.base, slot.len = addr, nbytes
    return array


def _paired(local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]]):
    """Cut both span lists at each other's boundaries: equal-length pieces, in order."""
    pairs, i, j = [], 0, 0
    (la, ln), (ra, rn) = (local[0] if local else (0, 0)), (remote[0] if remote else (0, 0))
    while i < len(local) and j < len(remote):
        n = min(ln, rn)
        if n:
            pairs.append((la, ra, n))
        la, ln, ra, rn = la + n, ln - n, ra + n, rn - n
        if ln == 0:
            i += 1
            if i < len(local):
                la, ln = local[i]
        if rn == 0:
            j += 1
            if j < len(remote):
                ra, rn = remote[j]
    return pairs


def read(pid: int, local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]]) -> None:
    """Copy the bytes of ``remote`` spans (addresses in process ``pid``) into the ``local``
    spans of this process, each list read as one byte stream. Raises OSError when the
    kernel refuses or copies less than asked (a span outside the peer's mapping)."""
    if sum(n for _, n in local) != sum(n for _, n in remote):
        raise ValueError("local and remote spans must cover the same number of bytes")
    fn = _function()
    if len(local) <= MAX_IOV and len(remote) <= MAX_IOV:
        batches = [(local, remote)]
    else:
        pairs = _paired(local, remote)
        batches = [([(a, n) for a, _, n in pairs[k:k + MAX_IOV]],
                    [(b, n) for _, b, n in pairs[k:k + MAX_IOV]])
                   for k in range(0, len(pairs), MAX_IOV)]
    for loc, rem in batches:
        want = sum(n for _, n in rem)
        if want == 0:
            continue
        got = fn(pid, _iovecs(loc), len(loc), _iovecs(rem), len(rem), 0)
        if got != want:
            errno = ctypes.get_errno()
            if got < 0:
                raise OSError(errno, f"process_vm_readv from pid {pid}: {os.strerror(errno)}")
            raise OSError(0, f"process_vm_readv from pid {pid}: copied {got} of {want} bytes")
