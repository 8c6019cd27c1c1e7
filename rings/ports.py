"""Binding listening ports, and saying who holds one when the bind fails.

Every service binds several ports (handshake ports, control, front door, metrics); when two
services are given the same one, the second must fail fast with a message that names the
port and the process holding it, not a bare ``EADDRINUSE``.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from rings.errors import ConfigError


def port_holder(port: int) -> str | None:
    """'pid N (command line)' of the local process listening on TCP ``port``, if visible.

    Linux only: the listening socket's inode from /proc/net/tcp{,6}, then the process whose
    file descriptors include that socket. Returns None when it cannot be found out (another
    user's process, another network namespace, not Linux).
    """
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 10:
                continue
            local, state, inode = parts[1], parts[3], parts[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A = LISTEN
                inodes.add(f"socket:[{inode}]")
    if not inodes:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}") in inodes:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                    return f"pid {pid} ({cmd.decode(errors='replace').strip()[:200]})"
            except OSError:
                continue
    return None


def bind_error(what: str, host: str, port: int, exc: OSError) -> ConfigError:
    """A ConfigError for a failed bind, naming the port and, if known, its holder."""
    holder = port_holder(port) if port else None
    held = f"; it is held by {holder}" if holder else ""
    return ConfigError(f"{what} cannot listen on {host}:{port}: {exc.strerror or exc}{held}")


def bind_socket(host: str, port: int, what: str) -> socket.socket:
    """A listening TCP socket on host:port, or a ConfigError naming port and holder."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise bind_error(what, host, port, exc) from exc
    return sock
