"""A full memory fence callable from pure Python, and the platform check behind it.

Owns :func:`full_fence`, which ``ring.py`` and ``wait.py`` call between *publishing an index*
and *reading the peer's waiter flag*. Nothing else in the package needs ordering guarantees
beyond what x86-64 gives for free.

Why a fence is needed (the lost wake-up)
    Parking is a Dekker-style handshake on two shared words. The waiter stores ``waiting = 1``
    and then loads the peer's index to re-check for data; the producer stores its new index and
    then loads ``waiting`` to decide whether to signal the eventfd. x86-64 is TSO: stores are
    not reordered with stores, loads not with loads, payload-then-index publication needs no
    barrier, but a load *may* complete before an earlier store to a different address leaves
    the store buffer (store->load reordering; Intel SDM vol. 3A, "Memory Ordering in P6 and More Recent
    Processor Families"). Without a
    fence both sides can read the other's *old* value: the waiter sees no data and sleeps, the
    producer sees no waiter and does not signal, and the frame sits unread until the next
    timeout -- a lost wake-up. A full fence between the store and the load on *both* sides
    forbids that outcome (the classic store-buffering litmus test).

How we get one from Python
    Any ``lock``-prefixed read-modify-write (and ``xchg``) is a full barrier on x86-64: "loads
    and stores are not reordered with locked instructions" (same section). CPython exposes one
    without a compiler: acquiring and releasing an uncontended ``threading.Lock``. On Linux with
    CPython 3.11/3.12 the lock is a POSIX semaphore (``sys.thread_info.lock == "semaphore"``):
    ``acquire`` first runs ``sem_trywait`` and ``release`` runs ``sem_post``; glibc implements
    both with ``lock cmpxchg``, and POSIX (XBD 4.12, "Memory Synchronization") lists both among
    the functions that synchronize memory. On CPython 3.13+ the lock is a ``PyMutex`` whose
    fast path is a sequentially consistent compare-and-swap, again ``lock cmpxchg``. The lock
    is private to the process, so the fence never contends; it costs about 100-200 ns. The
    calls are opaque to the C compiler, so the interpreter cannot move the surrounding
    ``memoryview`` stores and loads across them either.

    A syscall alone is *not* used as the fence: ``syscall``/``sysret`` are not serializing and
    the kernel does not promise a barrier on every entry. ``membarrier(2)`` would give an
    asymmetric fence but needs registration and may be filtered by seccomp in containers.

Other architectures
    On weakly ordered CPUs (aarch64) plain stores of the payload and the index could also be
    reordered, which would need a barrier on every publication; the rings refuse to start
    there (:class:`~ringserve.shm.errors.UnsupportedPlatformError`) rather than corrupt data.
"""

from __future__ import annotations

import platform
import sys
import threading

from ringserve.shm.errors import UnsupportedPlatformError

_X86_64 = frozenset({"x86_64", "amd64", "AMD64"})

_lock = threading.Lock()
_acquire = _lock.acquire
_release = _lock.release


def full_fence() -> None:
    """Issue a full (store-load) memory barrier on this CPU.

    Safe to call from any thread: if another thread of this process holds the fence lock, the
    acquire blocks briefly and still executes a locked instruction.
    """
    _acquire()
    _release()


def no_fence() -> None:
    """A stand-in for :func:`full_fence` that orders nothing (used only by the litmus test)."""


def check_platform() -> None:
    """Raise :class:`UnsupportedPlatformError` unless the rings' ordering assumptions hold."""
    machine = platform.machine()
    if machine not in _X86_64:
        raise UnsupportedPlatformError(
            f"ringserve.shm rings need x86-64 (TSO ordering); this CPU is {machine!r}"
        )
    if not sys.platform.startswith("linux"):
        raise UnsupportedPlatformError(
            f"ringserve.shm rings need Linux (eventfd, /dev/shm); this is {sys.platform!r}"
        )
