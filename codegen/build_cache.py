"""On-disk cache of compiled kernels, and the compiler runner that fills it.

An entry is a directory ``<cache_dir()>/kernels/<name>-<key[:16]>`` holding the build's files and a
``manifest.json`` that records the full key, what went into it, and the sha256 and size of every file.
The key is the sha256 of everything that can change the output (template text, parameters, compiler
and CUTLASS versions, flags); see ``cached_build``.

Concurrency and crashes: an entry is built in a private temporary directory and renamed into place
only once complete, under a per-key file lock, so concurrent builders of one key compile once and
every reader sees a whole entry or none. An entry whose files no longer match its manifest (truncated,
edited, half-deleted) is treated as missing and rebuilt.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import filelock

from fp4compile import config

__all__ = [
    "KernelBuildError",
    "CacheEntry",
    "cache_dir",
    "find_nvcc",
    "nvcc_version",
    "run_compiler",
    "cache_key",
    "cached_build",
    "list_entries",
]

MANIFEST = "manifest.json"
# Bump when the layout of an entry changes, so old entries are not mistaken for new ones.
CACHE_FORMAT = 1
_PROGRESS_TTY_INTERVAL_S = 1.0
_PROGRESS_LOG_INTERVAL_S = 15.0


class KernelBuildError(RuntimeError):
    """A kernel could not be built (no compiler, compiler failure, unsupported environment).

    ``stderr`` holds the compiler's diagnostics (empty when no compiler ran), ``command`` the command
    line that failed, if any. Callers that can fall back to another implementation catch this.
    """

    def __init__(self, message: str, stderr: str = "", command: Optional[Sequence[str]] = None):
        self.stderr = stderr
        self.command = list(command) if command else None
        detail = f"\n--- compiler output (last 4000 chars) ---\n{stderr[-4000:]}" if stderr.strip() else ""
        super().__init__(message + detail)


def cache_dir() -> Path:
    """Root of the kernel cache: ``fp4compile.config.cache_dir`` (``FP4COMPILE_CACHE_DIR``), else ``~/.cache/fp4compile``."""
    return Path(config.cache_dir).expanduser() if config.cache_dir else Path.home() / ".cache" / "fp4compile"


def _kernels_root() -> Path:
    return cache_dir() / "kernels"


def find_nvcc() -> Optional[str]:
    """Path of nvcc: ``fp4compile.config.nvcc`` (``FP4COMPILE_NVCC``), else ``$CUDA_HOME/bin/nvcc``, else nvcc
    on PATH; None if absent."""
    if config.nvcc:
        return config.nvcc if Path(config.nvcc).exists() else None
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


@functools.lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> str:
    """The release line of ``nvcc --version`` (e.g. 'Cuda compilation tools, release 13.0, V13.0.88')."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"cannot run {nvcc} --version: {exc}") from exc
    lines = [line.strip() for line in out.splitlines() if "release" in line]
    return lines[-1] if lines else out.strip()


def nvcc_release(version: str) -> tuple[int, int]:
    """(major, minor) from an ``nvcc_version`` string."""
    match = re.search(r"release (\d+)\.(\d+)", version)
    if not match:
        raise KernelBuildError(f"cannot read the CUDA release from nvcc's version string {version!r}")
    return int(match.group(1)), int(match.group(2))


def run_compiler(cmd: Sequence[str], label: str, progress: bool = True, cwd: Optional[Path] = None) -> str:
    """Run a compiler command; return the command line and its output, raise ``KernelBuildError`` on failure.

    With ``progress``, a line with the elapsed seconds is kept up to date on stderr while it runs
    (rewritten in place on a terminal, one line every 15 s otherwise), since nvcc on CUTLASS takes minutes.
    """
    cmd = [str(c) for c in cmd]
    tty = progress and sys.stderr.isatty()
    start = time.monotonic()
    with tempfile.TemporaryFile(mode="w+") as log:
        try:
            proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, text=True)
        except OSError as exc:
            raise KernelBuildError(f"cannot start the compiler for {label}: {exc}", command=cmd) from exc
        if progress:
            _progress(f"compiling {label} ...", tty, final=not tty)
        last = start
        interval = _PROGRESS_TTY_INTERVAL_S if tty else _PROGRESS_LOG_INTERVAL_S
        while True:
            try:
                proc.wait(timeout=0.25)
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if progress and now - last >= interval:
                    last = now
                    _progress(f"compiling {label}: {now - start:.0f}s elapsed", tty, final=not tty)
            except BaseException:
                proc.kill()
                proc.wait()
                raise
        log.seek(0)
        output = "$ " + " ".join(cmd) + "\n" + log.read()
    elapsed = time.monotonic() - start
    if proc.returncode != 0:
        if progress:
            _progress(f"compiling {label}: failed after {elapsed:.0f}s", tty, final=True)
        raise KernelBuildError(
            f"{Path(cmd[0]).name} failed (exit {proc.returncode}) building {label}", stderr=output, command=cmd
        )
    if progress:
        _progress(f"compiling {label}: done in {elapsed:.0f}s", tty, final=True)
    return output


def _progress(text: str, tty: bool, final: bool) -> None:
    line = f"[fp4compile] {text}"
    if tty:
        sys.stderr.write("\r\033[K" + line + ("\n" if final else ""))
    else:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


# ----------------------------------------------------------------------------------------------
# Entries
# ----------------------------------------------------------------------------------------------


class CacheEntry:
    """A verified cache entry: its directory, manifest, and files by their names in the entry."""

    def __init__(self, path: Path, manifest: dict, from_cache: bool):
        self.path = path
        self.manifest = manifest
        self.from_cache = from_cache

    @property
    def key(self) -> str:
        return self.manifest["key"]

    def file(self, name: str) -> Path:
        return self.path / name


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_manifest(entry: Path, key: Optional[str] = None) -> Optional[dict]:
    """The entry's manifest if the entry is intact (every listed file present with its recorded size
    and sha256, and the key matches), else None."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        if key is not None and manifest.get("key") != key:
            return None
        for name, info in manifest["files"].items():
            path = entry / name
            if path.stat().st_size != info["size"] or _sha256(path) != info["sha256"]:
                return None
        return manifest
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _remove_entry(entry: Path) -> None:
    """Move a bad entry aside (atomic), then delete it, so no reader sees it half-deleted."""
    trash = entry.parent / f".trash-{entry.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(entry, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def cache_key(material: dict) -> str:
    """sha256 of the canonical JSON of ``material`` plus the cache format version."""
    blob = json.dumps({"cache_format": CACHE_FORMAT, **material}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def cached_build(
    name: str,
    material: dict,
    produce: Callable[[Path], Iterable[str]],
    progress: bool = True,
) -> CacheEntry:
    """Return the cache entry for ``material``, building it with ``produce`` if it is missing or corrupt.

    ``name`` is a readable prefix for the entry directory. ``material`` is JSON-serializable and holds
    everything the output depends on; its hash is the key. ``produce(tmpdir)`` writes the entry's files
    into ``tmpdir`` and returns the names of the files to keep (others are discarded). It runs at most
    once per key across processes sharing the cache directory.
    """
    key = cache_key(material)
    root = _kernels_root()
    entry = root / f"{name}-{key[:16]}"
    manifest = _read_manifest(entry, key)
    if manifest is not None:
        return CacheEntry(entry, manifest, from_cache=True)

    try:
        (root / ".locks").mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a read-only or invalid cache location: complete entries were still served above
        raise KernelBuildError(
            f"the kernel cache {root} is not writable ({exc}); set FP4COMPILE_CACHE_DIR (fp4compile.config.cache_dir) to a writable directory"
        ) from exc
    lock = filelock.FileLock(str(root / ".locks" / f"{key[:32]}.lock"))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        if progress:
            _progress(f"waiting for another process building {name} ...", False, final=True)
        lock.acquire()
    try:
        manifest = _read_manifest(entry, key)
        if manifest is not None:
            return CacheEntry(entry, manifest, from_cache=True)
        if entry.exists():
            if progress:
                _progress(f"cache entry {entry.name} is incomplete or corrupt; rebuilding", False, final=True)
            _remove_entry(entry)
        # Leftovers of builds of this key that were killed: nobody else can be using them under the lock.
        for stale in [*root.glob(f".tmp-{entry.name}-*"), *root.glob(f".trash-{entry.name}-*")]:
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=root))
        try:
            start = time.monotonic()
            keep = list(produce(tmp))
            files = {}
            for fname in keep:
                path = tmp / fname
                files[fname] = {"sha256": _sha256(path), "size": path.stat().st_size}
            for extra in tmp.iterdir():
                if extra.name not in files:
                    shutil.rmtree(extra) if extra.is_dir() else extra.unlink()
            manifest = {
                "key": key,
                "name": name,
                "material": material,
                "files": files,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "build_seconds": round(time.monotonic() - start, 1),
            }
            # The manifest is written last: an entry without one is never read as complete.
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True, default=str))
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; entries are shareable read-only artifacts
            os.rename(tmp, entry)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return CacheEntry(entry, manifest, from_cache=False)
    finally:
        lock.release()


def list_entries() -> list[dict]:
    """Every entry under the cache root, with its manifest's summary and whether it verifies."""
    root = _kernels_root()
    if not root.is_dir():
        return []
    entries = []
    for path in sorted(root.iterdir()):
        if path.name.startswith(".") or not path.is_dir():
            continue
        manifest = _read_manifest(path)
        raw = {}
        try:
            raw = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            pass
        entries.append(
            {
                "path": path,
                "name": raw.get("name", path.name),
                "key": raw.get("key", ""),
                "ok": manifest is not None,
                "files": sorted(raw.get("files", {})),
                "size": sum(f.stat().st_size for f in path.iterdir() if f.is_file()),
                "created": raw.get("created", ""),
                "material": raw.get("material", {}),
            }
        )
    return entries
