"""The simulated NVML library served from a process of its own, as a real driver's work runs in the
kernel: outside the calling daemon's interpreter lock.

A real `libnvidia-ml.so` call is an ioctl; nvidia-ml-py calls it through ctypes, which releases
the interpreter lock for the call's whole length, so a daemon thread waiting on the driver does not
hold up the event loop. FakeNvmlLib is Python: run in the daemon's process, every simulated call
(the host lock, the state file, the sysfs tree it renders) holds the daemon's lock, and on 64 GPUs
an apply keeps it busy most of the time: the daemon's latency then measures the simulator. Here
the daemon's `pynvml.nvmlLib` is a RemoteNvmlLib that ships each call's arguments to a child process
serving one FakeNvmlLib (the same simulator, the same state files) and waits on a socket, the lock
released, as ctypes would.

Arguments cross as nvidia-ml-py made them: a `byref`, a ctypes pointer, an array, a structure or
scalar passed by value, a Python int, bytes or None. The child rebuilds each as the same ctypes type
(nvidia-ml-py's own classes), runs the call, and sends back the bytes of every object the call could
write, which are copied into the caller's objects. Handles are the server's addresses, opaque to the
caller as a real library's are. A structure that holds a pointer into the caller's memory cannot
cross: such a call raises TypeError (gpud makes none; gpud.host.nvidia's calls are listed in
docs/internals.md). Sessions are the caller's: the child opens them under the daemon's pid and name,
so DIR/proc shows the daemon holding the device nodes, as it would on a host.

The child exits when its standard input closes: when the daemon exits, whatever way it ends.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

_HEADER = struct.Struct("!I")
_CArgObject = type(ctypes.byref(ctypes.c_int()))
_START_LIMIT = 60.0  # seconds the child may take to listen (imports on a loaded 2-CPU machine)


# --- ctypes types by name -----------------------------------------------------------------------
# A type crosses as a key both sides resolve to the same class: ("T", module, name) for a class
# defined at a module's top level (nvidia-ml-py's structures, ctypes' scalars), ("P", key) for
# POINTER(key), ("A", key, length) for an array.

def _type_key(t: Any) -> tuple:
    if issubclass(t, ctypes.Array):
        return ("A", _type_key(t._type_), t._length_)
    if issubclass(t, ctypes._Pointer):
        return ("P", _type_key(t._type_))
    name = t.__qualname__
    module = sys.modules.get(t.__module__)
    if module is None or getattr(module, name, None) is not t:
        raise TypeError(f"the simulated NVML cannot pass a {name} across processes (not a module-level type)")
    return ("T", t.__module__, name)


_TYPES: dict[tuple, Any] = {}


def _type_of(key: tuple) -> Any:
    t = _TYPES.get(key)
    if t is None:
        t = _TYPES[key] = _resolve(key)
    return t


def _resolve(key: tuple) -> Any:
    if key[0] == "A":
        return _type_of(key[1]) * key[2]
    if key[0] == "P":
        return ctypes.POINTER(_type_of(key[1]))
    module = sys.modules.get(key[1])
    if module is None:
        __import__(key[1])
        module = sys.modules[key[1]]
    return getattr(module, key[2])


def _bytes_of(obj: Any) -> bytes:
    return ctypes.string_at(ctypes.addressof(obj), ctypes.sizeof(obj))


def _opaque(t: type) -> bool:
    """A handle type: a pointer to a structure with no fields (nvidia-ml-py's struct_c_nvmlDevice_t...)."""
    return issubclass(t, ctypes.Structure) and not getattr(t, "_fields_", None)


def _check_flat(t: Any) -> None:
    """Refuse a structure holding a pointer into the caller's memory (the child cannot follow it)."""
    while issubclass(t, ctypes.Array):
        t = t._type_
    if issubclass(t, (ctypes.Structure, ctypes.Union)):
        for field in getattr(t, "_fields_", ()):
            ft = field[1]
            if issubclass(ft, ctypes._Pointer) and not _opaque(ft._type_) or ft in (ctypes.c_void_p, ctypes.c_char_p):
                raise TypeError(f"the simulated NVML cannot pass {t.__qualname__} across processes: its field "
                                f"{field[0]} points into the caller's memory")
            _check_flat(ft)


# --- the caller's side --------------------------------------------------------------------------

_KEYS: dict[type, tuple] = {}  # type -> its key, checked flat once (a call's types repeat)


def _key(t: type) -> tuple:
    key = _KEYS.get(t)
    if key is None:
        _check_flat(t)
        key = _KEYS[t] = _type_key(t)
    return key


def _pack(arg: Any) -> tuple[tuple, Any]:
    """(what crosses, the caller's object the call's output is copied back into, or None)."""
    if arg is None or isinstance(arg, (bool, int, float, bytes, str)):
        return ("py", arg), None
    if isinstance(arg, _CArgObject):
        obj = arg._obj  # type: ignore[attr-defined]
        return ("ref", _key(type(obj)), _bytes_of(obj)), obj
    if isinstance(arg, ctypes.c_char_p):
        return ("py", arg.value), None
    if isinstance(arg, ctypes.c_void_p):
        return ("addr", ("T", "ctypes", "c_void_p"), arg.value or 0), None
    if isinstance(arg, ctypes._Pointer):
        if _opaque(arg._type_):
            return ("addr", _key(type(arg)), ctypes.cast(arg, ctypes.c_void_p).value or 0), None
        if not arg:
            return ("null", _key(type(arg))), None
        obj = arg.contents
        return ("ptr", _key(type(obj)), _bytes_of(obj)), obj
    if isinstance(arg, ctypes.Array):  # passed as a pointer to its first element: the call writes it
        return ("arr", _key(type(arg)), _bytes_of(arg)), arg
    if isinstance(arg, (ctypes.Structure, ctypes.Union, ctypes._SimpleCData)):
        return ("val", _key(type(arg)), _bytes_of(arg)), None
    raise TypeError(f"the simulated NVML cannot pass a {type(arg).__name__} across processes")


def _send(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise ConnectionError("the simulated NVML process closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> Any:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return pickle.loads(_recv_exact(sock, n))


class RemoteNvmlLib:
    """Stands in for `CDLL("libnvidia-ml.so.1")` in the calling process: each function sends its
    call to the child process and waits there, the interpreter lock released (one connection per
    calling thread, so threads wait on the child side by side, as they would on a driver)."""

    def __init__(self, host_dir: str):
        from gpud.sim.nvml_abi import IMPLS
        from gpud.sim.nvml_lib import own_comm  # importing it registers every fake function in IMPLS

        self.host_dir = str(host_dir)
        self._names = frozenset(IMPLS)  # the functions the fake library has (others: not found)
        self._fns: dict[str, Any] = {}
        self._local = threading.local()
        self._dir = tempfile.mkdtemp(prefix="gpud-sim-nvml-")
        self._address = os.path.join(self._dir, "nvml.sock")
        comm = own_comm()
        self._child = subprocess.Popen(
            [sys.executable, "-m", "gpud.sim.nvml_process", self.host_dir, self._address, str(os.getpid()), comm],
            stdin=subprocess.PIPE, close_fds=True)
        self._wait_listening()

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + _START_LIMIT
        while not os.path.exists(self._address):
            if self._child.poll() is not None:
                raise RuntimeError(f"the simulated NVML process exited with {self._child.returncode} before serving")
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the simulated NVML process did not listen within {_START_LIMIT:.0f} s")
            time.sleep(0.01)

    def _conn(self) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(self._address)
            self._local.sock = sock
        return sock

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in self._names:
            raise AttributeError(name)
        fn = self._fns.get(name)
        if fn is None:
            def fn(*args: Any, _name: str = name) -> Any:
                return self._call(_name, args)

            fn.__name__ = name
            self._fns[name] = fn
        return fn

    def _call(self, name: str, args: tuple) -> Any:
        packed, outs = zip(*(_pack(a) for a in args), strict=True) if args else ((), ())
        sock = self._conn()
        _send(sock, (name, packed))
        kind, value, written = _recv(sock)
        for obj, data in zip(outs, written, strict=True):
            if obj is not None and data is not None:
                ctypes.memmove(ctypes.addressof(obj), data, len(data))
        if kind == "raise":
            raise value
        return value

    def close(self) -> None:
        """Stop the child (it also stops by itself when this process ends)."""
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            sock.close()
            self._local.sock = None
        if self._child.poll() is None:
            self._child.stdin.close()  # type: ignore[union-attr]
            try:
                self._child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._child.kill()
                self._child.wait()
        elif self._child.stdin is not None:
            self._child.stdin.close()
        for path in (self._address, self._dir):
            try:
                os.rmdir(path) if path == self._dir else os.unlink(path)
            except OSError:
                pass


# --- the child ----------------------------------------------------------------------------------

def _unpack(item: tuple) -> tuple[Any, Any]:
    """(the argument as the fake library takes it, the object whose bytes go back, or None)."""
    kind = item[0]
    if kind == "py":
        return item[1], None
    if kind == "addr":
        t = _type_of(item[1])
        return (ctypes.cast(item[2], t) if item[2] else t()), None
    if kind == "null":
        return _type_of(item[1])(), None
    obj = _type_of(item[1]).from_buffer_copy(item[2])
    if kind == "ref":
        return ctypes.byref(obj), obj
    if kind == "ptr":
        return ctypes.pointer(obj), obj
    if kind == "arr":
        return obj, obj
    return obj, None  # "val"


def _serve_connection(lib: Any, sock: socket.socket) -> None:
    with sock:
        while True:
            try:
                name, packed = _recv(sock)
            except (ConnectionError, OSError):
                return
            args, outs = zip(*(_unpack(p) for p in packed), strict=True) if packed else ((), ())
            try:
                reply = ("return", getattr(lib, name)(*args))
            except Exception as e:  # noqa: BLE001 - whatever the call raised is raised in the caller's process
                reply = ("raise", e)
            written = [_bytes_of(o) if o is not None else None for o in outs]
            try:
                _send(sock, (*reply, written))
            except OSError:
                return


def _exit_with_parent() -> None:
    sys.stdin.buffer.read()  # EOF: the caller closed it or ended
    os._exit(0)


def serve(host_dir: str, address: str, pid: int, comm: str) -> None:
    import gpud.sim.nvml_lib as nvml_lib

    lib = nvml_lib.FakeNvmlLib(host_dir, pid=pid, comm=comm)
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = address + ".tmp"
    listener.bind(tmp)
    listener.listen(64)
    os.rename(tmp, address)  # the caller waits for the name: bound and listening once it exists
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_serve_connection, args=(lib, conn), daemon=True).start()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
