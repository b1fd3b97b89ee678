"""A text corpus that exists on every machine: the Python standard library's own source code.

The training study needs real text with real structure, but CI machines and GPU nodes may have no
network access. Every Python installation ships several megabytes of `.py` files, so the corpus is
the `.py` sources of the *running* interpreter's standard library:

- root: ``sysconfig.get_paths()["stdlib"]``, discovered at run time;
- excluded: ``site-packages`` / ``dist-packages`` (third-party code varies between machines),
  ``__pycache__``, and the standard library's own test suites (directories named ``test``,
  ``tests`` or ``idle_test``). The test suites are excluded because they are more than half of the
  bytes and much of them is generated data (long literals, deliberately malformed encodings) rather
  than code; ``include_tests=True`` keeps them;
- tokens: raw bytes, vocabulary 256. Files are joined in sorted relative-path order, each followed by
  a NUL byte (``DOC_SEPARATOR``), which does not occur in ordinary source;
- split: by file. A file goes to validation when the SHA-256 of its relative path (POSIX form),
  read as a number, falls in the first ``val_fraction`` of the range. The split depends only on the
  path, so it is the same on every machine with the same Python version, and it never cuts a file.

The corpus differs between Python versions (3.11 vs 3.12 stdlib), so runs are comparable only on the
same interpreter version; ``Corpus.stats()`` records the version and sizes for the run log.

With ``packages=True`` (``train_gpt.py --corpus stdlib+packages``) the corpus also holds the ``.py``
files of the interpreter's installed packages (``sysconfig``'s ``purelib`` and ``platlib``), named
``site-packages/<relative path>`` for the split. That is many times the standard library on a machine
with a scientific stack, enough for runs of 100M+ tokens in well under one epoch, but it differs
between machines (whatever is installed); ``max_bytes`` caps it with a deterministic sample: files
taken in the order of the SHA-256 of ``"sample/" + name`` until the cap, before the split. The run
log records the file counts and sizes.

The concatenated token tensors are cached in memory only (per process); nothing is written to disk.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import sysconfig
from pathlib import Path
from typing import Iterator, Optional

import torch

__all__ = [
    "DOC_SEPARATOR",
    "VOCAB_SIZE",
    "Corpus",
    "SOURCES",
    "stdlib_root",
    "package_roots",
    "list_source_files",
    "is_validation_file",
    "load_corpus",
    "batches",
    "fixed_batches",
]

VOCAB_SIZE = 256
DOC_SEPARATOR = 0
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_PACKAGES_LABEL = "site-packages"
SOURCES = ("stdlib", "stdlib+packages")


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def package_roots() -> list[Path]:
    """The running interpreter's installed-package directories (purelib, platlib) that exist, without repeats."""
    roots: list[Path] = []
    for key in ("purelib", "platlib"):
        path = Path(sysconfig.get_paths()[key])
        if path.is_dir() and all(path.resolve() != r.resolve() for r in roots):
            roots.append(path)
    return roots


def list_source_files(root: Path, include_tests: bool = False) -> list[str]:
    """Relative POSIX paths of the corpus files under ``root``, sorted."""
    root = Path(root)
    skip = _EXCLUDED_DIRS if include_tests else _EXCLUDED_DIRS | _TEST_DIRS
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # os.walk order depends on the file system; prune here, sort at the end.
        dirnames[:] = [d for d in dirnames if d not in skip]
        for name in filenames:
            # Regular, readable files only: installed packages can hold dangling links, and some
            # installations have files only their owner may read.
            path = os.path.join(dirpath, name)
            if name.endswith(".py") and os.path.isfile(path) and os.access(path, os.R_OK):
                found.append(Path(dirpath, name).relative_to(root).as_posix())
    return sorted(found)


def is_validation_file(relative_path: str, val_fraction: float) -> bool:
    """Deterministic, machine-independent split decision for one file."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < val_fraction * 2**64


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Token tensors (uint8, one byte per token) of the two splits and the files behind them."""

    root: str
    train: torch.Tensor
    val: torch.Tensor
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    include_tests: bool = False
    packages: tuple[str, ...] = ()  # installed-package roots, when the corpus holds them
    max_bytes: Optional[int] = None
    available_files: int = 0  # files found before the max_bytes sample

    @property
    def test_files(self) -> int:
        """Files from the standard library's test suites (directories ``test``, ``tests``, ``idle_test``)."""
        return sum(1 for f in self.train_files + self.val_files if _TEST_DIRS & set(f.split("/")[:-1]))

    def split(self, name: str) -> torch.Tensor:
        if name not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {name!r}")
        return self.train if name == "train" else self.val

    def stats(self) -> dict:
        return {
            "source": "python-stdlib+packages-py" if self.packages else "python-stdlib-py",
            "include_tests": self.include_tests,
            "test_files": self.test_files,
            "python_version": platform.python_version(),
            "root": self.root,
            "package_roots": list(self.packages),
            "package_files": sum(1 for f in self.train_files + self.val_files if f.startswith(_PACKAGES_LABEL + "/")),
            "max_bytes": self.max_bytes,
            "available_files": self.available_files,
            "vocab_size": VOCAB_SIZE,
            "train_files": len(self.train_files),
            "val_files": len(self.val_files),
            # One token per byte, separators included.
            "train_tokens": self.train.numel(),
            "val_tokens": self.val.numel(),
            "train_bytes": self.train.numel(),
            "val_bytes": self.val.numel(),
        }

    def describe(self) -> str:
        s = self.stats()
        tests = ""
        if self.include_tests:
            tests = (f" (with tests: {s['test_files']} files)" if s["test_files"]
                     else " (tests asked for, but this Python's standard library has no test suites)")
        what = "stdlib .py sources"
        if self.packages:
            what = f"stdlib and installed-package .py sources ({s['package_files']} package files)"
        if self.max_bytes is not None and s["available_files"] > s["train_files"] + s["val_files"]:
            what += f", a {self.max_bytes / 1e6:g} MB sample of {s['available_files']} files"
        return (
            f"corpus: Python {s['python_version']} {what}{tests}, byte tokens (vocab 256); "
            f"train {s['train_files']} files / {s['train_tokens']:,} tokens, "
            f"val {s['val_files']} files / {s['val_tokens']:,} tokens"
        )


_CACHE: dict[tuple, Corpus] = {}


def _concatenate(paths: dict[str, Path], files: list[str]) -> torch.Tensor:
    chunks = []
    for name in files:
        chunks.append(paths[name].read_bytes())
        chunks.append(bytes([DOC_SEPARATOR]))
    data = b"".join(chunks)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _corpus_paths(root: Path, include_tests: bool, packages: list[Path]) -> dict[str, Path]:
    """Corpus file name -> path: stdlib files by their relative path, package files as site-packages/<rel>."""
    paths = {rel: root / rel for rel in list_source_files(root, include_tests=include_tests)}
    for package_root in packages:
        for rel in list_source_files(package_root, include_tests=include_tests):
            paths.setdefault(f"{_PACKAGES_LABEL}/{rel}", package_root / rel)
    return paths


def _sample(paths: dict[str, Path], max_bytes: int) -> list[str]:
    """Files in the order of SHA-256("sample/" + name), as many as fit in ``max_bytes`` (at least one)."""
    order = sorted(paths, key=lambda n: hashlib.sha256(f"sample/{n}".encode("utf-8")).digest())
    chosen, total = [], 0
    for name in order:
        size = paths[name].stat().st_size + 1  # + the separator
        if chosen and total + size > max_bytes:
            continue  # a smaller file further on may still fit
        chosen.append(name)
        total += size
    return sorted(chosen)


def load_corpus(
    root: Optional[os.PathLike] = None,
    val_fraction: float = 0.05,
    include_tests: bool = False,
    packages: bool = False,
    max_bytes: Optional[int] = None,
) -> Corpus:
    """Load (or return the in-memory cached) corpus. ``root`` defaults to the stdlib.

    ``packages`` adds the installed packages' sources; ``max_bytes`` samples files (deterministically)
    when the whole would be larger.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root = Path(root) if root is not None else stdlib_root()
    package_dirs = package_roots() if packages else []
    key = (str(root.resolve()), val_fraction, include_tests, tuple(map(str, package_dirs)), max_bytes)
    if key not in _CACHE:
        paths = _corpus_paths(root, include_tests, package_dirs)
        if not paths:
            raise FileNotFoundError(f"no .py files under {root}" + "".join(f" or {p}" for p in package_dirs))
        files = sorted(paths) if max_bytes is None else _sample(paths, max_bytes)
        val_files = [f for f in files if is_validation_file(f, val_fraction)]
        train_files = [f for f in files if not is_validation_file(f, val_fraction)]
        if not val_files or not train_files:
            raise ValueError(f"split of {len(files)} files left one side empty; change val_fraction")
        _CACHE[key] = Corpus(
            root=str(root),
            train=_concatenate(paths, train_files),
            val=_concatenate(paths, val_files),
            train_files=tuple(train_files),
            val_files=tuple(val_files),
            include_tests=include_tests,
            packages=tuple(map(str, package_dirs)),
            max_bytes=max_bytes,
            available_files=len(paths),
        )
    return _CACHE[key]


def _batch_at(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    index = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    window = tokens[index].long()
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def batches(
    tokens: torch.Tensor,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    device: Optional[torch.device | str] = None,
    skip: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (x, y) int64 batches [batch_size, seq_len] of windows at random offsets.

    ``y`` is ``x`` shifted by one token. The offsets come from a ``torch.Generator`` seeded with
    ``seed`` on the CPU, so the sequence of batches is the same on every run and every device.
    ``skip`` starts the sequence that many batches in (a resumed run continues where it stopped).
    """
    if tokens.numel() < seq_len + 2:
        raise ValueError(f"split has {tokens.numel()} tokens, fewer than seq_len + 2 = {seq_len + 2}")
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")
    generator = torch.Generator().manual_seed(seed)
    high = tokens.numel() - seq_len - 1
    for _ in range(skip):
        torch.randint(0, high, (batch_size,), generator=generator)
    while True:
        starts = torch.randint(0, high, (batch_size,), generator=generator)
        x, y = _batch_at(tokens, starts, seq_len)
        if device is not None:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        yield x, y


def fixed_batches(
    tokens: torch.Tensor,
    n_batches: int,
    batch_size: int,
    seq_len: int,
    seed: int = 1234,
    device: Optional[torch.device | str] = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same ``n_batches`` batches every time: a fixed evaluation set."""
    stream = batches(tokens, batch_size, seq_len, seed=seed, device=device)
    return [next(stream) for _ in range(n_batches)]


if __name__ == "__main__":
    corpus = load_corpus()
    print(corpus.describe())
    print(f"root: {corpus.root}")
