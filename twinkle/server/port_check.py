"""Is the API's port free? Asked before `launch` starts anything, so a second server on a busy port stops with
one line instead of reaching the first server's health check and reporting itself ready.
"""

from __future__ import annotations

import errno
import socket


def port_taken(host: str, port: int) -> str | None:
    """None when the API can listen on host:port; otherwise one line saying which port is taken and by what."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # uvicorn sets SO_REUSEADDR too: a port in TIME_WAIT after a restart is free for it, and so for us
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
            return None
        except OSError as error:
            if error.errno == errno.EADDRNOTAVAIL:
                return (f"http_options.host {host} is not an address of this machine; use 127.0.0.1 (this "
                        "machine only) or 0.0.0.0 (every interface)")
            if error.errno == errno.EACCES:
                return f"port {port} on {host} needs root (ports below 1024); choose another http_options.port"
            if error.errno != errno.EADDRINUSE:
                return f"cannot listen on {host}:{port}: {error.strerror}"
    owner = _listener(port)
    return (f"port {port} on {host} is already in use{f' by {owner}' if owner else ''}; stop it, or set "
            "http_options.port (TWINKLE_PORT in the cookbook configs) to a free port")


def _listener(port: int) -> str:
    """The process listening on `port`, as 'PID N (command line)', or '' when this user may not know."""
    try:
        import psutil
    except ImportError:
        return ""
    try:
        connections = psutil.net_connections(kind="inet")
    except (psutil.Error, OSError):
        return ""  # other users' sockets are hidden without privileges
    for connection in connections:
        if connection.status == psutil.CONN_LISTEN and connection.laddr and connection.laddr.port == port:
            if connection.pid is None:
                return ""
            try:
                command = " ".join(psutil.Process(connection.pid).cmdline())
            except psutil.Error:
                return f"PID {connection.pid}"
            return f"PID {connection.pid} ({_shorten(command)})"
    return ""


def _shorten(command: str, limit: int = 120) -> str:
    return command if len(command) <= limit else command[: limit - 3] + "..."
