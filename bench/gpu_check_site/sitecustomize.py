"""Loaded by every Python process that ``bench/gpu_check.py`` starts.

This folder is on their PYTHONPATH. Two guards, so that the check proves what it claims on any
machine, the CPU rehearsal included:

* **no network**: a socket may connect only to this machine (loopback, ``localhost``, its own host
  name; Unix sockets), and only such names are resolved; anything else raises ``OSError`` at once.
  Native code (NCCL, c10d's TCPStore) is not Python and is not guarded; torchrun --standalone keeps
  to localhost.
* **only the private target folder provides the carried packages**: the top-level import names in
  ``$DPSGD_GPU_CHECK_HIDE`` are found in ``$DPSGD_GPU_CHECK_SITE`` or not at all, so a package this
  machine happens to hold elsewhere (this machine's venv, during the rehearsal) cannot stand in for
  a wheel missing from ``.whl/``.

A ``sitecustomize`` further along ``sys.path`` (a distribution's own) is run afterwards.
"""

import importlib.machinery
import importlib.util
import os
import socket
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_SITE = os.environ.get("DPSGD_GPU_CHECK_SITE", "")
_HIDE = frozenset(n for n in os.environ.get("DPSGD_GPU_CHECK_HIDE", "").split(",") if n)
_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", socket.gethostname(), ""}


def _local(host) -> bool:
    host = host.decode() if isinstance(host, bytes) else str(host)
    return (
        host in _LOCAL_NAMES
        or host.startswith("127.")
        or host in ("::1", "0.0.0.0", "::")
        or host.startswith("::ffff:127.")
    )


def _refuse(what):
    raise OSError(f"gpu-check: network disabled, refused {what}")


_connect, _connect_ex, _getaddrinfo = (
    socket.socket.connect,
    socket.socket.connect_ex,
    socket.getaddrinfo,
)


def _guarded_connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and not _local(address[0]):
        _refuse(f"a connection to {address!r}")
    return _connect(self, address)


def _guarded_connect_ex(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and not _local(address[0]):
        _refuse(f"a connection to {address!r}")
    return _connect_ex(self, address)


def _guarded_getaddrinfo(host, *a, **kw):
    if host is not None and not _local(host):
        raise socket.gaierror(
            socket.EAI_NONAME, f"gpu-check: network disabled, refused to resolve {host!r}"
        )
    return _getaddrinfo(host, *a, **kw)


socket.socket.connect, socket.socket.connect_ex = _guarded_connect, _guarded_connect_ex
socket.getaddrinfo = _guarded_getaddrinfo


class _OnlyFromSite:
    """Finds the top-level packages of ``_HIDE`` in the target folder alone."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if "." in name or name not in _HIDE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, [_SITE]) if _SITE else None
        if spec is None:
            raise ModuleNotFoundError(
                f"No module named {name!r} in the gpu-check target folder "
                f"{_SITE or '(none)'}: add its wheel to bench/wheelhouse.py",
                name=name,
            )
        return spec

    @staticmethod
    def invalidate_caches():
        pass


if _HIDE:
    sys.meta_path.insert(0, _OnlyFromSite)

# run the next sitecustomize on the path, as if this one were not there
for _p in sys.path:
    if _p and os.path.abspath(_p) != _HERE:
        _spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [_p])
        if (
            _spec is not None
            and _spec.origin
            and os.path.dirname(os.path.abspath(_spec.origin)) != _HERE
        ):
            _mod = importlib.util.module_from_spec(_spec)
            _spec.loader.exec_module(_mod)
            break
