"""CIFAR-10 for the VQ-VAE trainer: one LightningDataModule over three on-disk layouts, offline first.

``CIFAR10DataModule(data_root=...)`` finds the data in this order:

1. ``<data_root>/cifar-10-batches-py`` — the official release, read by ``torchvision.datasets.CIFAR10``;
2. ``<data_root>/train`` and ``<data_root>/test`` — an ImageFolder tree (one folder per class);
3. ``<data_root>`` *is* a ``.tar.gz``/``.tgz``/``.tar`` archive of such a tree, or ``<data_root>`` holds exactly
   one (e.g. ``cifar10-jpeg.tar.gz``) — extracted once into a cache directory and reused;
4. nothing found and ``download=True``: torchvision downloads the official release into ``data_root``.

Offline with no data, the error says where to put it. A corrupt or truncated archive raises an error and leaves
nothing behind in the cache (extraction goes to a temporary directory that is renamed only when complete).

Splits: ``train`` is the official training set minus a held-out ``val`` set of ``val_size`` images (a fixed,
seeded split, the same for every run so that runs compare on the same images); ``test`` is the official test
set. ``train_subset`` keeps the first ``N`` images of a fixed permutation of the remaining training images.
Images are float tensors in ``[0, 1]`` of shape ``(3, 32, 32)``; labels are the CIFAR-10 class indices.

Classes: an ImageFolder tree's classes are its visible sub-folders; hidden entries (``.ipynb_checkpoints``, any
name starting with ``.``) are ignored at every depth, and ``train/`` and ``test/`` must hold the same class folders
(else :class:`ClassMismatchError` naming the difference). ``classes`` holds the names in label order; checkpoints
record them (the data module's ``state_dict``) and resuming, evaluation, the readout and the prior check them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision import datasets, transforms
from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

from softvq._checks import check_non_negative_int, check_positive_int
from softvq.data.archive import (  # noqa: F401 - the archive errors and helpers, re-exported with the data module
    ARCHIVE_SUFFIXES,
    CorruptArchiveError,
    UnsafeArchiveError,
    default_cache_dir,
    extract_archive,
    find_image_folder,
    is_archive,
    sha256_file,
)
from softvq.data.sampling import GlobalBatchSampler

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
SPLIT_SEED = 0  # fixed: the val split and the training subset do not change with the run's --seed


class DataNotFoundError(FileNotFoundError):
    """No CIFAR-10 in any supported layout at the given root (and no download)."""


class BadImageError(ValueError):
    """An image file that cannot be decoded, or is not ``IMAGE_SIZE`` x ``IMAGE_SIZE`` pixels."""

    def __init__(self, message: str) -> None:
        # Raised in a DataLoader worker, it reaches the main process rebuilt from the worker's whole traceback
        # (torch's ExceptionWrapper.reraise): keep the last line's message, which names the file.
        if "Original Traceback" in message:
            last = message.rstrip().splitlines()[-1]
            message = last.partition(f"{type(self).__name__}: ")[2] or last
        super().__init__(message)


class ClassMismatchError(ValueError):
    """Two class lists that must be the same (train/ and test/, or the data and a checkpoint) differ."""


IMAGE_SIZE = 32


def load_image(path: str) -> Image.Image:
    """An ImageFolder image as RGB, checked: undecodable files and other sizes than 32x32 raise
    :class:`BadImageError` naming the file (also from DataLoader workers, which re-raise it)."""
    try:
        with open(path, "rb") as f:
            image = Image.open(f)
            image = image.convert("RGB")  # decodes now, while the file is open
    except (OSError, SyntaxError, ValueError) as err:  # PIL's UnidentifiedImageError is an OSError
        raise BadImageError(f"cannot decode image {path}: {err}; the data set is corrupt") from err
    if image.size != (IMAGE_SIZE, IMAGE_SIZE):
        width, height = image.size
        raise BadImageError(f"image {path} is {width}x{height} pixels; CIFAR-10 images are {IMAGE_SIZE}x{IMAGE_SIZE} "
                            f"(resize the data set to 32x32)")
    return image


def _not_found_message(root: Path) -> str:
    return (
        f"no CIFAR-10 data found at {root}. Provide one of:\n"
        f"  - {root}/cifar-10-batches-py/  (the official python release; with internet access pass download=True:\n"
        f"    --data.download true to the softvq-* commands, --download to the eval studies; or\n"
        f"    fetch https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz and extract it into {root})\n"
        f"  - {root}/train/<class>/*.jpg and {root}/test/<class>/*.jpg  (an ImageFolder tree)\n"
        f"  - an ImageFolder archive (.tar.gz), passed as the data root itself, e.g. "
        f"../shared/data/cifar10-jpeg.tar.gz (--data.data_root to the softvq-* commands, --data-root to the eval "
        f"studies)"
    )


def resolve_cifar10(
    data_root: str | os.PathLike, download: bool = False, cache_dir: str | os.PathLike | None = None
) -> tuple[str, Path]:
    """Find CIFAR-10 under ``data_root``: returns ``("torchvision", root)`` or ``("imagefolder", folder)``.

    See the module docstring for the search order. Raises :class:`DataNotFoundError` (with instructions) when
    nothing is found and ``download`` is off or fails.
    """
    root = Path(data_root).expanduser()
    if is_archive(root):
        return "imagefolder", extract_archive(root, cache_dir, validate=_same_classes_in(root))
    if root.is_dir():
        if (root / "cifar-10-batches-py").is_dir():
            return "torchvision", root
        folder = find_image_folder(root)
        if folder is not None:
            return "imagefolder", folder
        archives = sorted(p for p in root.iterdir() if is_archive(p))
        if len(archives) == 1:
            return "imagefolder", extract_archive(archives[0], cache_dir, validate=_same_classes_in(archives[0]))
        if len(archives) > 1:
            names = ", ".join(p.name for p in archives)
            raise DataNotFoundError(f"{root} holds several archives ({names}); pass one of them as the data root")
    elif root.exists():
        raise DataNotFoundError(f"data root {root} is a file but not a .tar.gz/.tgz/.tar archive")
    if download:
        try:
            root.mkdir(parents=True, exist_ok=True)
            datasets.CIFAR10(str(root), train=True, download=True)
            datasets.CIFAR10(str(root), train=False, download=True)
        except (OSError, RuntimeError) as err:  # URLError is an OSError
            raise DataNotFoundError(f"downloading CIFAR-10 into {root} failed ({type(err).__name__}: {err}).\n"
                                    + _not_found_message(root)) from err
        return "torchvision", root
    raise DataNotFoundError(_not_found_message(root))


def _hidden(name: str) -> bool:
    """Hidden entries (``.ipynb_checkpoints``, ``.DS_Store``, ``._img.jpg``): never a class, never an image."""
    return name.startswith(".")


class ImageFolderTree(datasets.ImageFolder):
    """``torchvision.datasets.ImageFolder`` that ignores hidden folders and files at any depth, so that an editor's or
    notebook's ``.ipynb_checkpoints/`` is neither a class (shifting every label) nor a source of images."""

    def __init__(self, root: str | os.PathLike, transform: Callable | None = None) -> None:
        root = os.fspath(root)

        def visible_image(path: str) -> bool:
            parts = Path(os.path.relpath(path, root)).parts
            return not any(_hidden(p) for p in parts) and has_file_allowed_extension(path, IMG_EXTENSIONS)

        super().__init__(root, transform=transform, loader=load_image, is_valid_file=visible_image)

    def find_classes(self, directory: str | os.PathLike) -> tuple[list[str], dict[str, int]]:
        classes = folder_classes(Path(directory))
        if not classes:
            raise FileNotFoundError(f"no class folders in {directory}")
        return list(classes), {name: i for i, name in enumerate(classes)}


def folder_classes(folder: Path) -> tuple[str, ...]:
    """The class names of an ImageFolder split: its visible sub-folders, sorted."""
    return tuple(sorted(e.name for e in os.scandir(folder) if e.is_dir() and not _hidden(e.name)))


def check_same_classes(expected: Sequence[str], found: Sequence[str], expected_what: str, found_what: str) -> None:
    """Raise :class:`ClassMismatchError` naming the difference unless the two class lists are equal (order too: the
    label of a class is its position)."""
    expected, found = tuple(expected), tuple(found)
    if expected == found:
        return
    only_expected = [c for c in expected if c not in found]
    only_found = [c for c in found if c not in expected]
    if only_expected or only_found:
        diff = (f"only in {expected_what}: {only_expected or 'none'}; only in {found_what}: {only_found or 'none'}")
    else:
        diff = f"same names in another order: {list(expected)} vs {list(found)}"
    raise ClassMismatchError(f"{found_what} has other classes than {expected_what} ({len(found)} vs "
                             f"{len(expected)}; {diff}), so its labels would mean other classes")


def _same_classes_in(archive: Path) -> Callable[[Path], None]:
    """The check :func:`extract_archive` runs on an archive's extracted tree before caching it: ``train/`` and
    ``test/`` hold the same class folders (a :class:`ClassMismatchError` naming the archive otherwise)."""
    def check(folder: Path) -> None:
        check_same_classes(folder_classes(folder / "train"), folder_classes(folder / "test"), f"{archive}: train/",
                           f"{archive}: test/")
    return check


def split_classes(source: str, root: Path) -> tuple[str, ...]:
    """The class names of a resolved source, checked to be the same in ``train/`` and ``test/``.

    Raises:
        ClassMismatchError: the two splits of an ImageFolder tree have other class folders (naming the difference).
    """
    if source == "torchvision":
        return CLASSES
    train, test = folder_classes(root / "train"), folder_classes(root / "test")
    check_same_classes(train, test, f"{root / 'train'}", f"{root / 'test'}")
    return train


def load_split(source: str, root: Path, train: bool, transform: Callable | None = None) -> Dataset:
    """The official train (``train=True``) or test split of a resolved source, as a torchvision dataset."""
    if source == "torchvision":
        try:
            return datasets.CIFAR10(str(root), train=train, download=False, transform=transform)
        except RuntimeError as err:  # torchvision's md5 check of the batch files
            raise DataNotFoundError(f"the CIFAR-10 python release in {root / 'cifar-10-batches-py'} is corrupt or "
                                    f"incomplete ({err}); delete it and download again (--download)") from err
    folder = root / ("train" if train else "test")
    try:
        return ImageFolderTree(folder, transform=transform)
    except FileNotFoundError as err:  # no class folders, or class folders without images
        raise DataNotFoundError(f"{folder} holds no images in the ImageFolder layout (<class>/<image>): {err}") from err


def split_indices(n: int, val_size: int, train_subset: int | None) -> tuple[list[int], list[int]]:
    """Fixed split of ``n`` training images into (train, val) index lists; see the module docstring."""
    if not 0 <= val_size < n:
        raise ValueError(f"val_size must be in [0, {n}) for a training set of {n} images, got {val_size}")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
    val, train = order[:val_size], order[val_size:]
    if train_subset is not None:
        if train_subset > len(train):
            raise ValueError(f"train_subset={train_subset} exceeds the {len(train)} training images left after "
                             f"holding out val_size={val_size}")
        train = train[:train_subset]
    return train, val


class CIFAR10DataModule(L.LightningDataModule):
    """CIFAR-10 train / held-out val / official test loaders, from any layout :func:`resolve_cifar10` accepts.

    Args:
        data_root: directory or archive; see the module docstring.
        batch_size: images per batch (per process under DDP).
        val_size: training images held out for validation (fixed split); 0 disables validation.
        train_subset: keep only this many training images (quick runs); ``None`` = all.
        num_workers: DataLoader worker processes.
        seed: seed of the training order (a new permutation each epoch from ``seed + epoch``; see
            :class:`softvq.data.sampling.GlobalBatchSampler`, which also shards every split under DDP: use it with
            ``Trainer(use_distributed_sampler=False)``).
        download: allow torchvision to download the official release when nothing is found locally.
        cache_dir: where archives are extracted (default :func:`default_cache_dir`).
    """

    def __init__(
        self,
        data_root: str | os.PathLike = "data",
        batch_size: int = 128,
        val_size: int = 5000,
        train_subset: int | None = None,
        num_workers: int = 2,
        download: bool = False,
        cache_dir: str | os.PathLike | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.data_root = Path(data_root)
        self.batch_size = check_positive_int("batch_size", batch_size)
        self.val_size = check_non_negative_int("val_size", val_size)
        self.train_subset = None if train_subset is None else check_positive_int("train_subset", train_subset)
        self.num_workers = check_non_negative_int("num_workers", num_workers)
        self.download = download
        self.cache_dir = cache_dir
        self.seed = int(seed)
        self.transform = transforms.ToTensor()
        self.source: tuple[str, Path] | None = None
        self.classes: tuple[str, ...] | None = None  # the class names, label order; set by setup()
        self._checkpoint_classes: tuple[str, ...] | None = None  # from a checkpoint being resumed
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    def prepare_data(self) -> None:
        # Runs on one process per node: the place to download or extract.
        resolve_cifar10(self.data_root, self.download, self.cache_dir)

    def setup(self, stage: str | None = None) -> None:
        if self.source is None:
            self.source = resolve_cifar10(self.data_root, download=False, cache_dir=self.cache_dir)
        source, root = self.source
        if self.classes is None:
            self.classes = split_classes(source, root)
            if self._checkpoint_classes is not None:
                self._check_checkpoint_classes()
        if stage in (None, "fit", "validate") and self.train_set is None:
            full = load_split(source, root, train=True, transform=self.transform)
            train_idx, val_idx = split_indices(len(full), self.val_size, self.train_subset)
            self.train_set, self.val_set = Subset(full, train_idx), Subset(full, val_idx)
        if stage in (None, "test", "predict") and self.test_set is None:
            self.test_set = load_split(source, root, train=False, transform=self.transform)

    # Lightning saves this in every checkpoint (under "CIFAR10DataModule") and hands it back when a run resumes.
    def state_dict(self) -> dict[str, Any]:
        """``{"classes": [...]}``: the class names, in label order, that the checkpoint's model was trained on."""
        return {} if self.classes is None else {"classes": list(self.classes)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check that a resumed checkpoint was trained on the same classes as this data (after :meth:`setup`)."""
        classes = state_dict.get("classes")
        if classes is None:
            return
        self._checkpoint_classes = tuple(classes)
        if self.classes is not None:
            self._check_checkpoint_classes()

    def _check_checkpoint_classes(self) -> None:
        assert self.classes is not None and self._checkpoint_classes is not None
        check_same_classes(self._checkpoint_classes, self.classes, "the checkpoint", f"the data at {self.data_root}")

    def _loader(self, dataset: Dataset | None, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("call setup() before asking for a DataLoader")
        trainer = self.trainer  # None outside a Trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        # Under DDP every process must take the same number of equally sized training steps.
        sampler = GlobalBatchSampler(len(dataset), self.batch_size, shuffle=train, seed=self.seed,
                                     drop_last=train and world > 1, num_replicas=world, rank=rank)
        if trainer is not None:
            # Lightning creates the training iterator (with workers, persistent ones that start prefetching) before
            # it calls set_epoch, and a run resumed from an end-of-epoch checkpoint still reads current_epoch = e - 1
            # then: start from the order of the epoch the fit loop will run next.
            progress = getattr(getattr(trainer, "fit_loop", None), "epoch_progress", None)
            sampler.set_epoch(progress.current.processed if progress is not None else trainer.current_epoch)
        # Loader seeds come from their own generator, not the global random state, which the model's data
        # initialisation and dead-code restarts draw from: resuming must not shift it.
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0, drop_last=False,
                          generator=torch.Generator().manual_seed(self.seed))

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, train=False)
