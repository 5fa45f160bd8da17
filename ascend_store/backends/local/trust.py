"""Whom a client trusts as its local pool: checks on the socket, its directory and the arena.

Any local user can create a socket or a directory where we expect ours (the default path
lives in /tmp when ``XDG_RUNTIME_DIR`` is unset), and whoever answers at the socket names
the arena we map. So before connecting, and before mapping, every file involved must be
owned by this process's uid (or ``local.trusted_uid``) and closed to group and others:
then only that user can have created the socket in that directory, and only that user can
read or write the arena. A pool that fails a check is refused with ``UntrustedPool`` (the
engine recomputes); it is never adopted, and nothing is created inside a foreign directory.
Checks use ``lstat``/``O_NOFOLLOW``, so a symlink is refused, never followed.
"""

from __future__ import annotations

import mmap
import os
import stat

from ascend_store.backends.base import BackendUnavailable
from ascend_store.backends.local.arena import is_arena


class UntrustedPool(BackendUnavailable):
    """The socket, its directory or the arena belongs to someone else or is open to others."""


def trusted_uids(extra_uid: int | None) -> frozenset[int]:
    return frozenset({os.getuid()} | ({extra_uid} if extra_uid is not None else set()))


def _check(path: str, st: os.stat_result, what: str, uids: frozenset[int], kind, kind_name: str) -> None:
    def refuse(why: str):
        raise UntrustedPool(f"refusing the local pool: its {what} {path} {why}")

    if not kind(st.st_mode):
        refuse(f"is not a {kind_name}")
    if st.st_uid not in uids:
        refuse(f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()}) or local.trusted_uid; "
               "another user may have created it")
    if st.st_mode & 0o077:
        refuse(f"has mode {stat.S_IMODE(st.st_mode):04o}, open to group or others (needs "
               f"{'0700' if kind is stat.S_ISDIR else '0600'})")


def check_dir(directory: str, uids: frozenset[int]) -> None:
    """The socket's directory: ours and private. Its parent must not let others replace it
    (not writable by group/others unless sticky, as /tmp is)."""
    _check(directory, os.lstat(directory), "socket directory", uids, stat.S_ISDIR, "directory")
    parent = os.path.dirname(directory.rstrip("/")) or "/"
    pst = os.stat(parent)
    if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
        raise UntrustedPool(f"refusing the local pool: {parent}, the parent of its socket directory, "
                            f"is writable by others without the sticky bit "
                            f"(mode {stat.S_IMODE(pst.st_mode):04o})")


def check_socket(socket_path: str, uids: frozenset[int]) -> None:
    """Raise ``BackendUnavailable`` when nothing is there, ``UntrustedPool`` when it is foreign."""
    try:
        check_dir(os.path.dirname(socket_path), uids)
        st = os.lstat(socket_path)
    except FileNotFoundError:
        raise BackendUnavailable(f"no pool at {socket_path}") from None
    _check(socket_path, st, "socket", uids, stat.S_ISSOCK, "socket")


def check_arena(path, capacity, uids: frozenset[int], map_it: bool = True) -> mmap.mmap | None:
    """Check that the arena a pool named is an arena of a trusted user that really holds
    ``capacity`` bytes, all backed (a sparse arena could SIGBUS on write); map it if asked."""
    if not isinstance(path, str) or not is_arena(path) \
            or not isinstance(capacity, int) or capacity <= 0:
        raise UntrustedPool(f"refusing the local pool: it named {path!r} ({capacity!r} bytes) as its arena")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise UntrustedPool(f"refusing the local pool: cannot open its arena {path}: "
                            f"{exc.strerror}") from None
    try:
        st = os.fstat(fd)
        _check(path, st, "arena", uids, stat.S_ISREG, "regular file")
        if st.st_size < capacity:
            raise UntrustedPool(f"refusing the local pool: its arena {path} has {st.st_size} bytes, "
                                f"less than the {capacity} it claims")
        if st.st_blocks * 512 < capacity:
            raise UntrustedPool(f"refusing the local pool: its arena {path} is not backed "
                                f"({st.st_blocks * 512} of {capacity} bytes allocated)")
        return mmap.mmap(fd, capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) if map_it else None
    finally:
        os.close(fd)


def prepare_dir(directory: str, uids: frozenset[int]) -> None:
    """Create the socket's directory 0700, or accept an existing one that passes
    ``check_dir`` (one of ours that is only readable by others is made private first)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.lstat(directory)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022:
        os.chmod(directory, 0o700)
    check_dir(directory, uids)
