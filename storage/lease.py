"""The run lock as a lease object with an expiry, taken and renewed with conditional writes (issue 17).

A lock that lives in a process (``flock``) dies with its process but does not reach across machines, and an
object store has no locks at all. A lease does both: ``<run>/_LEASE.json`` names its holder (host, pid, the
process's start time, a random token) and a wall-clock expiry.

- **Take**: a create-only write (``Store.create``); when a lease is there already, it may be taken over only
  once it has expired, or when its holder is a dead process on this very host, by ``Store.replace_if`` on the
  tag just read. Of two processes taking over the same expired lease, one wins.
- **Hold**: a daemon thread renews the expiry every third of the term with ``replace_if`` on the tag it last
  wrote. A renewal that finds another tag has lost the lease (the holder stalled past its expiry and someone
  took over): ``Lease.check`` then raises, and a stage checks before it commits, so a stalled holder never
  commits over the new one.
- **Release**: a last conditional write that marks the lease expired.

Expiry compares wall clocks of different machines: keep them in NTP sync, and keep the term (``ttl``, 60 s by
default) well above their skew and above the longest stall a holder may survive.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from solrl.config import ConfigError
from solrl.storage.store import Store

LEASE = "_LEASE.json"
DEFAULT_TTL = 60.0


class LeaseHeld(ConfigError):
    """Another live holder has the lease (exit 2 at the command line)."""


class LeaseLost(RuntimeError):
    """This process held the lease, but it expired and another holder took it: stop writing."""


def _process_start(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), None when
    no such process runs: with the pid, an identity that a reused pid does not repeat. A process that has exited
    and that its parent has not reaped yet (state Z, a zombie; X, dead) runs no more: None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return None if fields[0] in ("Z", "X") else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def holder_alive(holder: dict[str, Any]) -> bool | None:
    """Whether the lease's holder process still runs: True or False for a holder on this host, None (unknown)
    for one elsewhere."""
    if holder.get("host") != socket.gethostname():
        return None
    pid, start = holder.get("pid"), holder.get("start")
    return isinstance(pid, int) and start is not None and _process_start(pid) == start


@dataclass
class Lease:
    """One lease object: ``store`` / ``key`` with a term of ``ttl`` seconds."""

    store: Store
    key: str
    ttl: float = DEFAULT_TTL
    token: str = field(default_factory=lambda: secrets.token_hex(8))
    _tag: str | None = None
    _lost: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _record(self, expires: float) -> bytes:
        pid = os.getpid()
        holder = {"host": socket.gethostname(), "pid": pid, "start": _process_start(pid), "token": self.token}
        return json.dumps({"holder": holder, "expires": expires, "ttl": self.ttl}, sort_keys=True).encode()

    def read(self) -> tuple[dict[str, Any] | None, str | None]:
        """The lease object as stored (None when absent or unreadable) and its tag."""
        tag = self.store.tag(self.key)
        if tag is None:
            return None, None
        try:
            data = json.loads(self.store.read_bytes(self.key))
        except FileNotFoundError:
            return None, None
        except ValueError:
            return {}, tag  # unreadable: a torn write of some other tool; treated as expired
        return (data if isinstance(data, dict) else {}), tag

    def _live_holder(self, data: dict[str, Any] | None) -> str | None:
        """``pid P on H for another S s`` where ``data`` (a stored lease) is unexpired and its holder not known
        dead, else None."""
        holder = (data or {}).get("holder") or {}
        expires = float((data or {}).get("expires", 0.0))
        if expires > time.time() and holder_alive(holder) is not False:
            return (
                f"pid {holder.get('pid')} on {holder.get('host')} for another {max(0.0, expires - time.time()):.0f} s"
            )
        return None

    def held_by(self) -> str | None:
        """Who holds the lease now (``pid P on H for another S s``), or None when it is free, expired or held by
        a process known dead; reads only, so it works on a store this process cannot write."""
        data, seen = self.read()
        return None if seen is None else self._live_holder(data)

    def acquire(self) -> None:
        """Take the lease and start renewing it.

        Raises:
            LeaseHeld: a live holder has it; the message names the holder and when its lease expires.
        """
        for _ in range(3):  # a lease released or taken between our read and our write: look again
            if tag := self.store.create(self.key, self._record(time.time() + self.ttl)):
                break
            data, seen = self.read()
            if seen is None:
                continue
            if held := self._live_holder(data):  # unexpired, holder not known dead
                raise LeaseHeld(f"{self.store.url(self.key)} is held by {held}")
            if tag := self.store.replace_if(self.key, self._record(time.time() + self.ttl), seen):
                break
        else:
            raise LeaseHeld(f"{self.store.url(self.key)} changed hands three times while being taken; try again")
        self._tag, self._lost = tag, None
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew_loop, name=f"lease {self.key}", daemon=True)
        self._thread.start()

    def renew(self) -> None:
        """Push the expiry one term ahead.

        Raises:
            LeaseLost: another holder changed the lease since this process last wrote it.
        """
        with self._lock:
            if self._lost:
                raise LeaseLost(self._lost)
            tag = self.store.replace_if(self.key, self._record(time.time() + self.ttl), self._tag or "")
            if tag is None:
                data, _ = self.read()
                holder = (data or {}).get("holder") or {}
                self._lost = (
                    f"{self.store.url(self.key)} was taken by pid {holder.get('pid')} on {holder.get('host')} after "
                    f"this process's lease expired; this process stops writing"
                )
                raise LeaseLost(self._lost)
            self._tag = tag

    def check(self) -> None:
        """Raise ``LeaseLost`` if a renewal found the lease taken; call before a commit."""
        if self._lost:
            raise LeaseLost(self._lost)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self.renew()
            except LeaseLost:
                return
            except OSError:
                continue  # the store did not answer this time; the next renewal may, within the term

    def release(self) -> None:
        """Stop renewing and mark the lease expired (if it is still this process's)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            if self._tag and not self._lost:
                self.store.replace_if(self.key, self._record(0.0), self._tag)
            self._tag = None


@contextmanager
def hold(store: Store, key: str, ttl: float = DEFAULT_TTL) -> Iterator[Lease]:
    """Hold the lease ``key`` of ``store`` for the ``with`` block.

    Raises:
        LeaseHeld: a live holder has it.
    """
    lease = Lease(store, key, ttl)
    lease.acquire()
    try:
        yield lease
    finally:
        lease.release()
