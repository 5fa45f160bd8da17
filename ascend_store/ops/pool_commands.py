"""``ascend-store pool serve / status / inspect / gc``: a standalone local pool, run and looked at."""

from __future__ import annotations

import json
import os
import socket
import stat
import sys

from ascend_store.backends.local.pool_config import meminfo
from ascend_store.common.config import ConfigError, LocalPoolConfig, parse_size
from ascend_store.ops.user_error import EXIT_USAGE, GIB, UserError


def check_capacity(text: str, force: bool, memory: int | None) -> int:
    """The arena size in bytes; refused above ``memory`` bytes unless ``force``."""
    try:
        capacity = parse_size(text, "--capacity")
    except ConfigError as exc:
        raise UserError(f"ascend-store pool serve: {exc}", EXIT_USAGE) from None
    if memory and capacity > memory and not force:
        raise UserError(f"ascend-store pool serve: --capacity {text} is {capacity / GIB:.1f} GiB but this "
                        f"machine has {memory / GIB:.1f} GiB of memory; the arena is reserved in full at "
                        "start, so it would not fit or would push the machine into swap. Give a smaller "
                        "--capacity, or pass --force to create it anyway.",
                        EXIT_USAGE)
    return capacity


def check_socket_dir(socket_path: str) -> None:
    """An existing socket directory must be ours and 0700 already: the pool creates a
    missing one 0700, but never changes one it did not create (a --socket in a home
    directory would otherwise close that directory to everyone)."""
    d = os.path.dirname(os.path.abspath(socket_path))
    st = os.lstat(d) if os.path.lexists(d) else None
    mode = st and stat.S_IMODE(st.st_mode)
    if st is None or stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and mode == 0o700:
        return
    found = "a symlink" if stat.S_ISLNK(st.st_mode) else f"mode {mode:04o}, uid {st.st_uid}"
    raise UserError(f"ascend-store pool serve: the socket's directory {d} must be a directory owned by "
                    f"this user (uid {os.getuid()}) with mode 0700 ({found}); the pool does not change a "
                    f"directory it did not create: 'chmod 700 {d}', or give a --socket in a new directory "
                    "(created 0700).", EXIT_USAGE)


def serve(args) -> int:
    from ascend_store.backends.local.launcher import ping
    from ascend_store.backends.local.server import serve

    capacity = check_capacity(args.capacity, args.force, meminfo("MemTotal"))
    try:
        disk_capacity = parse_size(args.disk_capacity, "--disk-capacity")
    except ConfigError as exc:
        raise UserError(f"ascend-store pool serve: {exc}", EXIT_USAGE) from None
    check_socket_dir(args.socket)
    running = ping(args.socket)
    if running:
        raise UserError(f"ascend-store pool serve: a pool already answers at {args.socket} "
                        f"(pid {running.get('pid', '?')}); stop it first or give another --socket.")
    try:
        serve(args.socket, capacity, lease_ttl_s=args.lease_ttl, parent_pid=args.parent_pid,
              disk_path=args.disk_path, disk_capacity=disk_capacity, idle_exit_s=args.idle_exit,
              disk_codec=args.disk_codec)
    except OSError as exc:
        raise UserError(f"ascend-store pool serve: cannot create the pool at {args.socket}: {exc}") from None
    return 0


def _nobody_listens(path: str) -> bool:
    """A socket file no process listens on (its pool was killed): a connect is refused at
    once, where the pool's client would wait for its deadline."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except ConnectionRefusedError:
            return True
        except OSError:  # missing, not a socket, not ours: the client says which
            pass
    return False


def query_pool(args) -> int:
    from ascend_store.backends.base import BackendUnavailable
    from ascend_store.backends.local.client import LocalBackend

    def no_pool(why: str) -> UserError:
        return UserError(f"ascend-store pool {args.pool_cmd}: {why}. Start one with 'ascend-store pool "
                         f"serve --socket {args.socket}', or give the --socket an engine uses.")

    if _nobody_listens(args.socket):
        raise no_pool(f"no pool at {args.socket} (the socket file is left from a pool that is gone)")
    client = LocalBackend(LocalPoolConfig(socket=args.socket, start="never"), timeout_s=2.0, map_arena=False)
    try:
        out = client.stats() if args.pool_cmd == "status" else [
            {"key": k, "bytes": n, "ready": r, "leases": le} for k, n, r, le in client.list(args.prefix)]
    except BackendUnavailable as exc:
        raise no_pool(str(exc)) from None
    finally:
        client.close()
    print(json.dumps(out, indent=2))
    return 0


def gc(args) -> int:
    from ascend_store.backends.local.launcher import gc_arenas

    if args.dir is not None and not os.path.isdir(args.dir):
        why = "not a directory" if os.path.exists(args.dir) else "no such directory"
        raise UserError(f"ascend-store pool gc: --dir {args.dir}: {why}", EXIT_USAGE)
    try:
        removed = gc_arenas(args.dir)
    except OSError as exc:
        raise UserError(f"ascend-store pool gc: {exc}") from None
    for path in removed:
        print(path)
    print(f"removed {len(removed)} arena(s)", file=sys.stderr)
    return 0
