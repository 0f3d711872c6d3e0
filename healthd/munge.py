"""A small ctypes binding to libmunge.so.2: encode and decode MUNGE credentials in-process, through a
chosen munged socket (no `munge`/`unmunge` subprocess per report).

Signatures, option numbers and error codes are those of munge's public header, dun/munge
`src/libmunge/munge.h` (munge 0.5.x; the values have not changed since 0.5):

    munge_err_t munge_encode (char **cred, munge_ctx_t ctx, const void *buf, int len);
    munge_err_t munge_decode (const char *cred, munge_ctx_t ctx, void **buf, int *len, uid_t *uid, gid_t *gid);
    const char *munge_strerror (munge_err_t e);
    munge_ctx_t munge_ctx_create (void);
    void        munge_ctx_destroy (munge_ctx_t ctx);
    const char *munge_ctx_strerror (munge_ctx_t ctx);
    munge_err_t munge_ctx_get (munge_ctx_t ctx, int opt, ...);   /* variadic: pointer to the option's type */
    munge_err_t munge_ctx_set (munge_ctx_t ctx, int opt, ...);   /* variadic: the option's value */

The credential string and the decoded payload are malloc()ed by libmunge; the caller frees them with
libc free() (munge.h: "the caller is responsible for freeing this memory"), which this module does on
every path, errors included (for EXPIRED, REWOUND and REPLAYED libmunge still returns the payload).

A context is created per call and destroyed after it: munge.h says a context used for decoding is
overwritten with the encoder's settings and should not be reused for encoding, nor shared between
threads without a lock. Creating one is a malloc and a strdup, cheap next to the socket round trip.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import struct
import threading
from dataclasses import dataclass
from socket import inet_ntoa

# munge_opt_t (munge.h)
MUNGE_OPT_CIPHER_TYPE = 0
MUNGE_OPT_MAC_TYPE = 1
MUNGE_OPT_ZIP_TYPE = 2
MUNGE_OPT_REALM = 3
MUNGE_OPT_TTL = 4  # int
MUNGE_OPT_ADDR4 = 5  # struct in_addr (4 bytes, network order)
MUNGE_OPT_ENCODE_TIME = 6  # time_t
MUNGE_OPT_DECODE_TIME = 7  # time_t
MUNGE_OPT_SOCKET = 8  # char *
MUNGE_OPT_UID_RESTRICTION = 9
MUNGE_OPT_GID_RESTRICTION = 10

# munge_ttl_t (munge.h)
MUNGE_TTL_MAXIMUM = -1
MUNGE_TTL_DEFAULT = 0

# munge_err_t (munge.h)
EMUNGE_SUCCESS = 0
EMUNGE_SNAFU = 1
EMUNGE_BAD_ARG = 2
EMUNGE_BAD_LENGTH = 3
EMUNGE_OVERFLOW = 4
EMUNGE_NO_MEMORY = 5
EMUNGE_SOCKET = 6
EMUNGE_TIMEOUT = 7
EMUNGE_BAD_CRED = 8
EMUNGE_BAD_VERSION = 9
EMUNGE_BAD_CIPHER = 10
EMUNGE_BAD_MAC = 11
EMUNGE_BAD_ZIP = 12
EMUNGE_BAD_REALM = 13
EMUNGE_CRED_INVALID = 14
EMUNGE_CRED_EXPIRED = 15
EMUNGE_CRED_REWOUND = 16
EMUNGE_CRED_REPLAYED = 17
EMUNGE_CRED_UNAUTHORIZED = 18
ERROR_NAMES: dict[int, str] = {v: k for k, v in dict(globals()).items() if k.startswith("EMUNGE_")}

LIBRARY = "libmunge.so.2"


class MungeError(Exception):
    """A libmunge call failed: `code` is the munge_err_t number, `name` its EMUNGE_* name, `message` the
    library's own text (munge_ctx_strerror when it has a detailed one, else munge_strerror)."""

    def __init__(self, code: int, message: str):
        self.code = code
        self.name = ERROR_NAMES.get(code, f"EMUNGE_{code}")
        self.message = message
        super().__init__(f"{self.name} ({code}): {message}")


class MungeUnavailable(MungeError):
    """libmunge.so.2 could not be loaded (package libmunge2 not installed)."""


@dataclass(frozen=True)
class Decoded:
    payload: bytes
    uid: int
    gid: int
    encode_addr: str  # dotted IPv4 of the encoding munged's origin (its --origin, else its host address)
    encode_time: int  # seconds since the epoch, as the encoding munged saw it
    ttl: int  # seconds


class _Lib:
    """The library's functions. munge_encode and munge_decode wait on munged over its socket, so they
    run with the GIL released (CDLL): other threads go on meanwhile (the controller's verifier threads
    overlap their round trips). Every other call is a few hundred nanoseconds of memory work and keeps
    the GIL (PyDLL): releasing it around each of them would hand the GIL to another thread up to nine
    times per decode, a context switch each when several threads verify."""

    def __init__(self, name: str = LIBRARY):
        try:
            lib = ctypes.CDLL(name, use_errno=True)
            quick = ctypes.PyDLL(name)
        except OSError as exc:
            raise MungeUnavailable(EMUNGE_SNAFU, f"cannot load {name} ({exc}); install the libmunge2 package") from exc
        libc = ctypes.PyDLL(ctypes.util.find_library("c") or "libc.so.6")
        self.free = libc.free
        self.free.argtypes = [ctypes.c_void_p]
        self.free.restype = None

        self.encode = lib.munge_encode
        self.encode.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self.encode.restype = ctypes.c_int
        self.decode = lib.munge_decode
        self.decode.argtypes = [
            ctypes.c_char_p,
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_int),
            ctypes.POINTER(ctypes.c_uint32),  # uid_t
            ctypes.POINTER(ctypes.c_uint32),  # gid_t
        ]
        self.decode.restype = ctypes.c_int
        self.strerror = quick.munge_strerror
        self.strerror.argtypes = [ctypes.c_int]
        self.strerror.restype = ctypes.c_char_p
        self.ctx_create = quick.munge_ctx_create
        self.ctx_create.argtypes = []
        self.ctx_create.restype = ctypes.c_void_p
        self.ctx_destroy = quick.munge_ctx_destroy
        self.ctx_destroy.argtypes = [ctypes.c_void_p]
        self.ctx_destroy.restype = None
        self.ctx_strerror = quick.munge_ctx_strerror
        self.ctx_strerror.argtypes = [ctypes.c_void_p]
        self.ctx_strerror.restype = ctypes.c_char_p
        # Variadic: no argtypes; every argument is passed as an explicit ctypes value of the C type
        # munge.h names for the option (int, char *, or a pointer), which is how the x86-64 and
        # aarch64 Linux ABIs pass variadic arguments too.
        self.ctx_get = quick.munge_ctx_get
        self.ctx_get.restype = ctypes.c_int
        self.ctx_set = quick.munge_ctx_set
        self.ctx_set.restype = ctypes.c_int


_lib: _Lib | None = None
_lib_lock = threading.Lock()


def lib() -> _Lib:
    global _lib
    if _lib is None:
        with _lib_lock:
            if _lib is None:
                _lib = _Lib()
    return _lib


def strerror(code: int) -> str:
    raw = lib().strerror(code)
    return raw.decode(errors="replace") if raw else f"munge error {code}"


def _error(L: _Lib, ctx: int, code: int) -> MungeError:
    raw = L.ctx_strerror(ctx) if ctx else None
    return MungeError(code, raw.decode(errors="replace") if raw else strerror(code))


def _context(L: _Lib, socket_path: str | None, ttl: int | None = None) -> int:
    ctx = L.ctx_create()
    if not ctx:
        raise MungeError(EMUNGE_NO_MEMORY, "munge_ctx_create returned NULL (out of memory)")
    try:
        if socket_path is not None:
            rc = L.ctx_set(ctypes.c_void_p(ctx), ctypes.c_int(MUNGE_OPT_SOCKET), ctypes.c_char_p(socket_path.encode()))
            if rc != EMUNGE_SUCCESS:
                raise _error(L, ctx, rc)
        if ttl is not None:
            rc = L.ctx_set(ctypes.c_void_p(ctx), ctypes.c_int(MUNGE_OPT_TTL), ctypes.c_int(ttl))
            if rc != EMUNGE_SUCCESS:
                raise _error(L, ctx, rc)
    except BaseException:
        L.ctx_destroy(ctx)
        raise
    return ctx


def encode(payload: bytes, socket: str | None = None, *, ttl: int | None = None) -> str:
    """A credential (the "MUNGE:...:" base64 string) carrying `payload`, made by the munged listening on
    `socket` (None: libmunge's default socket). `ttl` in seconds (None: the daemon's default;
    MUNGE_TTL_MAXIMUM: its maximum). Raises MungeError."""
    L = lib()
    ctx = _context(L, socket, ttl)
    cred = ctypes.c_void_p()
    try:
        buf = ctypes.create_string_buffer(bytes(payload), len(payload)) if payload else None
        rc = L.encode(ctypes.byref(cred), ctx, buf, len(payload))
        try:
            if rc != EMUNGE_SUCCESS:
                raise _error(L, ctx, rc)
            return ctypes.string_at(cred.value).decode("ascii")
        finally:
            if cred.value:
                L.free(cred)
    finally:
        L.ctx_destroy(ctx)


def decode(cred: str | bytes, socket: str | None = None) -> Decoded:
    """Validate `cred` through the munged on `socket` and return what it carries. Raises MungeError
    for every failure, including EMUNGE_CRED_REPLAYED (17), EMUNGE_CRED_EXPIRED (15) and
    EMUNGE_CRED_REWOUND (16), which libmunge reports even though it decoded the credential."""
    try:
        raw = cred.encode("ascii") if isinstance(cred, str) else bytes(cred)
    except UnicodeEncodeError:
        raise MungeError(EMUNGE_BAD_CRED, "credential is not ASCII") from None
    if b"\x00" in raw:
        raise MungeError(EMUNGE_BAD_CRED, "credential contains a NUL byte")
    L = lib()
    ctx = _context(L, socket)
    buf = ctypes.c_void_p()
    length = ctypes.c_int(0)
    uid = ctypes.c_uint32(0)
    gid = ctypes.c_uint32(0)
    try:
        rc = L.decode(raw, ctx, ctypes.byref(buf), ctypes.byref(length), ctypes.byref(uid), ctypes.byref(gid))
        try:
            if rc != EMUNGE_SUCCESS:
                raise _error(L, ctx, rc)
            payload = ctypes.string_at(buf.value, length.value) if buf.value and length.value > 0 else b""
        finally:
            if buf.value:
                L.free(buf)
        addr = ctypes.c_uint32(0)
        when = ctypes.c_int64(0)  # time_t on LP64 Linux
        ttl = ctypes.c_int(0)
        c = ctypes.c_void_p(ctx)
        for opt, out in ((MUNGE_OPT_ADDR4, addr), (MUNGE_OPT_ENCODE_TIME, when), (MUNGE_OPT_TTL, ttl)):
            rc = L.ctx_get(c, ctypes.c_int(opt), ctypes.byref(out))
            if rc != EMUNGE_SUCCESS:
                raise _error(L, ctx, rc)
        return Decoded(
            payload=payload,
            uid=uid.value,
            gid=gid.value,
            encode_addr=socket_ntoa(addr.value),
            encode_time=when.value,
            ttl=ttl.value,
        )
    finally:
        L.ctx_destroy(ctx)


def socket_ntoa(in_addr_value: int) -> str:
    """struct in_addr read as a native uint32 -> dotted quad (the bytes in memory are network order)."""
    return inet_ntoa(struct.pack("=I", in_addr_value))
