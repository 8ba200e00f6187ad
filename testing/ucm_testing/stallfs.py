"""A FUSE passthrough filesystem that can be told to stop answering (a stuck NFS hard mount or 3FS
FUSE mount) or to be full (ENOSPC), for fault benchmarks. Every call blocks while the mount is
stalled (a flag file exists) and carries on when it is resumed (the file is gone); only the calls
that change the filesystem (create, write, rename, unlink, setattr, ...) block while it is
write-stalled, only opens and reads of files while it is read-stalled (a server whose disks or
write path hang while its metadata still answers); writes fail with ENOSPC while another flag file
exists; kernel attribute caching is off so ``stat`` blocks too. A flag file rather than a signal:
libfuse's loop holds the main thread, where Python would run a signal handler.

With a delay, every call sleeps that long first: a network filesystem's round trip (an NFS
``GETATTR``, ``LOOKUP`` or ``READDIR`` is ~0.3 ms in one data centre), for benchmarks of what a
store's metadata traffic costs there.

    python -m ucm_testing.stallfs BACKING MOUNTPOINT FLAG_DIR [DELAY_S]

Needs libfuse 3 (Debian: ``fuse3``), the ``mfusepy`` package and the right to mount (root or
``/dev/fuse`` access); ``available()`` says whether this machine has them.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ucm_testing.processes import stop_process


def available() -> str | None:
    """None when a stall mount can run here, else why not."""
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:
        return f"mfusepy with libfuse 3 is needed ({e}); `apt-get install fuse3` and `pip install mfusepy`"
    if not os.path.exists("/dev/fuse") or not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not usable by this user"
    if shutil.which("fusermount3") is None and os.geteuid() != 0:
        return "fusermount3 is missing (Debian: fuse3)"
    return None


def _passthrough(backing: Path, flags: Path, delay_s: float = 0.0) -> Any:
    import mfusepy

    full = flags / FULL
    stalls: dict[str | None, list[Path]] = {
        None: [flags / STALLED],
        READS: [flags / STALLED, flags / READS_STALLED],
        WRITES: [flags / STALLED, flags / WRITES_STALLED],
    }

    def wait(kind: str | None = None) -> None:
        if delay_s:
            time.sleep(delay_s)
        while any(f.exists() for f in stalls[kind]):
            time.sleep(0.05)

    def room() -> None:
        if full.exists():
            raise mfusepy.FuseOSError(errno.ENOSPC)

    class Passthrough(mfusepy.Operations):
        use_ns = True

        def _p(self, path: str, kind: str | None = None) -> str:
            wait(kind)
            return str(backing) + path

        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            try:
                st = os.lstat(self._p(path))
            except OSError as e:
                raise mfusepy.FuseOSError(e.errno or errno.EIO) from None
            keys = ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_atime_ns", "st_mtime_ns", "st_ctime_ns")
            out = {k.replace("_ns", ""): getattr(st, k) for k in keys}
            return out

        def access(self, path: str, amode: int) -> int:
            if not os.access(self._p(path), amode):
                raise mfusepy.FuseOSError(errno.EACCES)
            return 0

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *os.listdir(self._p(path))]

        def statfs(self, path: str) -> dict[str, int]:
            st = os.statvfs(self._p(path))
            keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_frsize")
            return {k: getattr(st, k) for k in keys} | {"f_namemax": 255}

        def mkdir(self, path: str, mode: int) -> int:
            room()
            os.mkdir(self._p(path, WRITES), mode)
            return 0

        def rmdir(self, path: str) -> int:
            os.rmdir(self._p(path, WRITES))
            return 0

        def unlink(self, path: str) -> int:
            os.unlink(self._p(path, WRITES))
            return 0

        def rename(self, old: str, new: str) -> int:
            os.rename(self._p(old, WRITES), self._p(new))
            return 0

        def chmod(self, path: str, mode: int) -> int:
            os.chmod(self._p(path, WRITES), mode)
            return 0

        def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
            os.utime(self._p(path, WRITES), ns=times)
            return 0

        def truncate(self, path: str, length: int, fh: int | None = None) -> int:
            os.truncate(self._p(path, WRITES), length)
            return 0

        def open(self, path: str, flags: int) -> int:
            writing = flags & os.O_ACCMODE != os.O_RDONLY
            return os.open(self._p(path, WRITES if writing else READS), flags)

        def create(self, path: str, mode: int, fi: Any = None) -> int:
            room()
            return os.open(self._p(path, WRITES), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            wait(READS)
            return os.pread(fh, size, offset)

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            wait(WRITES)
            room()
            return os.pwrite(fh, data, offset)

        def flush(self, path: str, fh: int) -> int:
            wait(WRITES if fcntl.fcntl(fh, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY else READS)
            return 0

        def fsync(self, path: str, datasync: int, fh: int) -> int:
            wait(WRITES)
            os.fsync(fh)
            return 0

        def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
            wait(WRITES)
            return 0

        def release(self, path: str, fh: int) -> int:
            os.close(fh)
            return 0

    return Passthrough()


STALLED, READS_STALLED, WRITES_STALLED, FULL = "stalled", "reads-stalled", "writes-stalled", "full"
READS, WRITES = "reads", "writes"


class StallMount:
    """Runs the filesystem in a child process; its methods set and clear the flag files."""

    def __init__(self, backing: Path, mountpoint: Path, flags: Path, log: Path, delay_s: float = 0.0) -> None:
        self.backing, self.mountpoint, self.flags, self.log = backing, mountpoint, flags, log
        self.delay_s = delay_s
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> StallMount:
        for d in (self.backing, self.mountpoint, self.flags):
            d.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self._proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "ucm_testing.stallfs"),
                    *(str(self.backing), str(self.mountpoint), str(self.flags), str(self.delay_s)),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.mountpoint):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"stall mount did not come up; see {self.log}")
            time.sleep(0.1)
        return self

    def stall(self, only: str | None = None) -> None:
        """Every call blocks; with ``only`` ("reads" or "writes"), those calls only."""
        flag = {None: STALLED, READS: READS_STALLED, WRITES: WRITES_STALLED}[only]
        (self.flags / flag).touch()

    def resume(self) -> None:
        for flag in (STALLED, READS_STALLED, WRITES_STALLED):
            (self.flags / flag).unlink(missing_ok=True)

    def fill(self) -> None:
        (self.flags / FULL).touch()

    def make_room(self) -> None:
        (self.flags / FULL).unlink(missing_ok=True)

    def stop(self) -> None:
        if self._proc is None:
            return
        self.resume()
        self.make_room()
        subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True, check=False)
        stop_process(self._proc)


def main() -> None:
    import mfusepy

    backing, mountpoint, flags = Path(sys.argv[1]).resolve(), sys.argv[2], Path(sys.argv[3])
    delay_s = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    # attr/entry timeouts 0: the kernel asks us for every stat, as an NFS client revalidating would.
    mfusepy.FUSE(
        _passthrough(backing, flags, delay_s),
        mountpoint,
        foreground=True,
        nothreads=False,
        attr_timeout=0,
        entry_timeout=0,
        negative_timeout=0,
    )


if __name__ == "__main__":
    main()
