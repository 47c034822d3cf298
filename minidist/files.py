"""Reading a file that nothing can make block or flood: what minidist reads (a --config,
a checkpoint's files, a data shard's header, a corpus) goes through `open_regular`, which
refuses a FIFO, a device or a socket by kind before reading a byte, and `read_bounded`,
which refuses more bytes than the caller says such a file can hold. Chapter 08
(chapters/08_at_scale.md, its table of bad inputs). Exercised by tests/test_inputs.py.

Why not `Path.is_file()` then `open()`: a FIFO's open() blocks until a writer comes, and
the name may change kind between the check and the open. Opening with O_NONBLOCK never
blocks, and fstat on the opened descriptor tells the kind of what was really opened.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device",
         stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder"}


class NotARegularFile(ValueError):
    """A path minidist reads is not a plain file (or is larger than such a file can be)."""


def kind_of(mode: int) -> str:
    return KINDS.get(stat.S_IFMT(mode), "not a regular file")


def check_regular(path, what: str = "file") -> Path:
    """`path` as a Path if it names a regular file (following links); else NotARegularFile.
    A missing path raises FileNotFoundError as open() would. Never opens the path."""
    path = Path(path)
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise NotARegularFile(f"{what} {path} is {kind_of(mode)}, not a regular file")
    return path


def open_regular(path, what: str = "file"):
    """A binary file object for `path`, opened without blocking and refused unless what was
    opened is a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotARegularFile(f"{what} {path} is {kind_of(mode)}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path, limit: int, what: str = "file") -> bytes:
    """The bytes of regular file `path`, refused (before reading them) when it holds more
    than `limit` bytes: a file of that kind cannot be that big."""
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(size + 1) if size <= limit else b""  # (read(n) sets n bytes aside at once)
        if size < len(data) <= limit:  # grown since the fstat: the rest, still bounded
            data += f.read(limit + 1 - len(data))
    if size > limit or len(data) > limit:  # grown while read: refused all the same
        raise NotARegularFile(f"{what} {path} holds {max(size, len(data)):,} bytes, more than the "
                              f"{limit:,} such a file can hold")
    return data
