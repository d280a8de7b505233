"""The seccomp filter of every tool (through libseccomp's ``pyseccomp`` binding).

Built once per network setting with libseccomp, exported as a classic BPF program, and
loaded by each spawning thread with one prctl (a child inherits its thread's filter). What
it refuses, with EPERM unless said:

- debugging and reading other processes: ptrace, process_vm_readv/writev;
- the kernel keyring (keyctl, add_key, request_key), bpf, perf_event_open, userfaultfd;
- mounting in any form (mount, umount2, pivot_root, move_mount, open_tree, fsopen,
  fsconfig, fsmount, fspick, mount_setattr), chroot, setns;
- new user namespaces: unshare and clone with CLONE_NEWUSER; clone3, whose flags a filter
  cannot read, answers ENOSYS, so libc falls back to clone;
- io_uring (its operations would bypass this filter), kexec, module loading;
- sockets of families the profile does not allow (EAFNOSUPPORT): only AF_UNIX without
  network, AF_UNIX, AF_INET, AF_INET6 and AF_NETLINK with it.

Most of these need capabilities that tools no longer have; the filter is the second wall,
and the only one for unprivileged user namespaces, keyrings and socket families.
Syscalls of another architecture (i386 on x86_64) kill the process: libseccomp's default.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import tempfile

import pyseccomp as sc

DENIED = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "mount",
    "umount2",
    "pivot_root",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "chroot",
    "setns",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
)
CLONE_NEWUSER = 0x10000000
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_libc = ctypes.CDLL(None, use_errno=True)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def families(network: bool) -> frozenset[int]:
    return frozenset({AF_UNIX, AF_INET, AF_INET6, AF_NETLINK} if network else {AF_UNIX})


@functools.cache
def program(network: bool) -> bytes:
    """The filter as classic BPF (``struct sock_filter`` array), for the given setting."""
    f = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED:
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        except (OSError, ValueError):  # a syscall this libseccomp does not know
            continue
    for name in ("unshare", "clone"):
        f.add_rule(
            sc.ERRNO(errno.EPERM), name, sc.Arg(0, sc.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER)
        )
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    allowed = families(network)
    top = max(allowed)
    for name in ("socket", "socketpair"):
        f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), name, sc.Arg(0, sc.GT, top))
        for family in range(top):
            if family not in allowed:
                f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), name, sc.Arg(0, sc.EQ, family))
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()


class Loaded:
    """A program kept in memory in the form the kernel takes, ready for `load`."""

    def __init__(self, bpf: bytes) -> None:
        self._buf = ctypes.create_string_buffer(bpf, len(bpf))
        self._prog = _SockFprog(len(bpf) // 8, ctypes.addressof(self._buf))

    def load(self) -> None:
        """Install the filter on the calling thread (needs no_new_privs or CAP_SYS_ADMIN)."""
        if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(self._prog), 0, 0):
            err = ctypes.get_errno()
            raise OSError(err, f"seccomp: {errno.errorcode.get(err, err)}")


@functools.cache
def loaded(network: bool) -> Loaded:
    return Loaded(program(network))
