"""Archives of an image tree (``.tar.gz``, ``.tgz``, ``.tar``): extracted once into a cache directory, safely.

A corrupt or truncated archive raises :class:`CorruptArchiveError` and leaves nothing behind in the cache (extraction
goes to a temporary directory that is renamed only when complete); a member that would land outside the extraction
folder (an absolute name or one with ``..``), a link (symbolic or hard, wherever it points) or a device file raises
:class:`UnsafeArchiveError` before anything is extracted. An archive whose ``train/`` and ``test/`` fail a caller's
check (``validate``, e.g. other class folders in the two splits) is removed from the cache too.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tarfile
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")
_MARKER = ".softvq-complete"
log = logging.getLogger("softvq.data")


class CorruptArchiveError(RuntimeError):
    """The archive could not be read or extracted completely."""


class UnsafeArchiveError(CorruptArchiveError):
    """The archive holds a member that would land outside the extraction folder, a link, or a device file."""



def default_cache_dir() -> Path:
    """``$SOFTVQ_CACHE``, else ``$XDG_CACHE_HOME/softvq``, else ``~/.cache/softvq``."""
    if os.environ.get("SOFTVQ_CACHE"):
        return Path(os.environ["SOFTVQ_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "softvq"


def is_archive(path: Path) -> bool:
    return path.is_file() and path.name.endswith(ARCHIVE_SUFFIXES)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def expected_sha256(archive: Path) -> str | None:
    """The digest in ``<archive>.sha256`` (``sha256sum`` format) if that file exists."""
    sidecar = archive.with_name(archive.name + ".sha256")
    if not sidecar.is_file():
        return None
    text = sidecar.read_text().split()
    return text[0].lower() if text else None


def find_image_folder(root: Path) -> Path | None:
    """``root`` or a single sub-directory of it that holds ``train/`` and ``test/``."""
    for candidate in (root, *sorted(p for p in root.iterdir() if p.is_dir())):
        if (candidate / "train").is_dir() and (candidate / "test").is_dir():
            return candidate
    return None


def _safe_extractall(tar: tarfile.TarFile, dest: Path, archive: Path) -> None:
    """``extractall`` that refuses, before extracting anything, every member that is not a plain file or folder
    inside ``dest``: an absolute name, a name with ``..``, a link (symbolic or hard, even one pointing inside) or a
    device, with an :class:`UnsafeArchiveError` naming the member.

    Why not ``filter="data"`` alone: it re-roots absolute names and keeps links that stay inside ``dest``, which is
    safe but extracts what an image archive never holds; it still runs after the check, as a second guard."""
    def unsafe(what: str) -> UnsafeArchiveError:
        return UnsafeArchiveError(f"{archive} is unsafe to extract: {what}; refused, nothing extracted into the cache "
                                  f"(a CIFAR-10 archive holds only folders and image files under train/ and test/)")

    for member in tar.getmembers():
        name = Path(member.name)
        if name.is_absolute() or member.name.startswith(("/", "\\")) or ".." in name.parts:
            raise unsafe(f"member {member.name!r} would land outside the archive's folder")
        if not (member.isfile() or member.isdir()):
            kind = "a link" if member.issym() or member.islnk() else "a device or special file"
            raise unsafe(f"member {member.name!r} is {kind}")
    if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4
        try:
            tar.extractall(dest, filter="data")
        except tarfile.FilterError as err:
            raise unsafe(str(err)) from err
        return
    tar.extractall(dest)


def extract_archive(archive: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                    validate: Callable[[Path], object] | None = None) -> Path:
    """Extract an ImageFolder archive into the cache once and return the folder holding ``train/`` and ``test/``.

    The cache entry is keyed by the archive's SHA-256, so a changed archive is extracted anew and a reused one
    costs one hash. When ``<archive>.sha256`` exists beside the archive its digest is checked first. ``validate``
    (called with the folder holding ``train/`` and ``test/``) checks the tree before it enters the cache, and again
    when a cached entry is reused; whatever it raises propagates, and the entry is removed from the cache.

    Raises:
        FileNotFoundError: ``archive`` does not exist.
        CorruptArchiveError: digest mismatch, a truncated/corrupt archive, or no ``train/`` + ``test/`` inside;
            :class:`UnsafeArchiveError` (a subclass) for a member that is a link, a device or outside the archive's
            folder. Nothing is left in the cache in that case.
    """
    archive = Path(archive).expanduser()
    if not archive.is_file():
        raise FileNotFoundError(f"archive not found: {archive}")
    digest = sha256_file(archive)
    expected = expected_sha256(archive)
    if expected is not None and expected != digest:
        raise CorruptArchiveError(
            f"{archive} is corrupt or incomplete: its sha256 is {digest}, but {archive.name}.sha256 says {expected}; "
            f"copy or download the archive again")
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = cache / f"{archive.name.split('.')[0]}-{digest[:16]}"
    if (target / _MARKER).is_file():
        found = find_image_folder(target)
        if found is not None:
            if validate is not None:
                try:
                    validate(found)
                except BaseException:  # an entry cached before the check existed: it goes, as a new one would
                    shutil.rmtree(target, ignore_errors=True)
                    raise
            return found
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=cache))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is meant to be shared
    try:
        try:
            with tarfile.open(archive) as tar:
                _safe_extractall(tar, tmp, archive)
        except UnsafeArchiveError:
            raise
        except (tarfile.TarError, EOFError, OSError, zlib.error) as err:
            raise CorruptArchiveError(f"cannot extract {archive}: {type(err).__name__}: {err}. The archive is "
                                      f"corrupt or truncated; copy or download it again") from err
        found = find_image_folder(tmp)
        if found is None:
            raise CorruptArchiveError(f"{archive} holds no train/ and test/ folders (ImageFolder layout expected)")
        if validate is not None:
            validate(found)  # before the marker: a tree that fails it never enters the cache
        (tmp / _MARKER).write_text(digest + "\n")
        if target.exists():  # an incomplete earlier attempt, or a concurrent extraction that finished first
            if (target / _MARKER).is_file():
                shutil.rmtree(tmp)
                return find_image_folder(target)  # type: ignore[return-value]
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # once per archive (a reused entry says nothing): the unpacked tree is large and outlives the run
    log.info(f"unpacked {archive} into {target} (the data cache: $SOFTVQ_CACHE, default ~/.cache/softvq, or the "
             f"data module's cache_dir, --data.cache_dir; remove the folder to reclaim the space)")
    return find_image_folder(target)  # type: ignore[return-value]


