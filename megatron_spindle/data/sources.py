"""Where tools/build_multitask_dataset.py reads raw samples from: a folder of files, or WebDataset tar shards.

Both give each sample as ``(key, {field: RawFile})``, in order. A folder holds one file per sample and field,
``<key>.<field>.<ext>``. WebDataset shards (what img2dataset and most multimodal corpora ship) hold a sample's
files next to each other, named ``<key>.<suffix>``: the key is the member's path up to the first dot of its
file name (``/`` in it becomes ``_``), the suffix the rest (``jpg``, ``txt``, ``seg.png``). ``field_map``
(``{suffix: field}``) names the field each suffix feeds; members whose suffix it does not name (``json``
metadata, say) are left out. Without a map the suffix must be ``<field>.<ext>``, as in a folder. Shards are
read as streams, one after another, so no list of the corpus is ever held.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megatron_spindle.data.decode import KNOWN_EXTS
from megatron_spindle.data.shards import DatasetError, split_member


@dataclass(frozen=True)
class RawFile:
    ext: str  # how it decodes: jpg, wav, txt, npy, ...
    data: bytes
    name: str  # where it came from, for messages: a path, or "shard.tar:member"


def parse_field_map(items: list[str]) -> dict[str, str]:
    """``["jpg=vision", "txt=text,flac=audio"]`` -> ``{"jpg": "vision", "txt": "text", "flac": "audio"}``."""
    out: dict[str, str] = {}
    for item in (part for text in items for part in text.split(",") if part):
        suffix, sep, field = item.partition("=")
        suffix = suffix.lower().lstrip(".")
        if not sep or not suffix or not field or "." in field:
            raise DatasetError(f"--field-map: '{item}' is not SUFFIX=FIELD (e.g. jpg=vision)")
        if suffix.rsplit(".", 1)[-1] not in KNOWN_EXTS:
            raise DatasetError(f"--field-map: '{suffix}' does not end in a known extension ({', '.join(KNOWN_EXTS)})")
        if suffix in out:
            raise DatasetError(f"--field-map: suffix '{suffix}' given twice")
        out[suffix] = field
    return out


def folder_samples(root: Path) -> tuple[int, Iterator[tuple[str, dict[str, RawFile]]]]:
    """(number of samples, the samples in key order) of a folder of ``<key>.<field>.<ext>`` files."""
    files: dict[str, dict[str, Path]] = {}
    for p in sorted(root.iterdir()):
        if p.name.startswith(".") or not p.is_file():
            continue
        key, field, ext = split_member(p.name)
        _check_ext(ext, str(p))
        if field in files.setdefault(key, {}):
            raise DatasetError(f"sample '{key}' has two files for field '{field}': "
                               f"{files[key][field].name} and {p.name}")
        files[key][field] = p
    if not files:
        raise DatasetError(f"input {root} holds no files named <key>.<field>.<ext>")

    def read() -> Iterator[tuple[str, dict[str, RawFile]]]:
        for key in sorted(files):
            yield key, {f: RawFile(p.name.rsplit(".", 1)[1].lower(), p.read_bytes(), str(p))
                        for f, p in files[key].items()}

    return len(files), read()


def tar_shards(root: Path) -> list[Path] | None:
    """The WebDataset shards ``root`` is (a .tar file) or holds (a folder of .tar files, in name order); None for a
    folder of raw files. A folder with both is refused."""
    if root.is_file():
        if root.suffix != ".tar":
            raise DatasetError(f"input {root} is a file but not a .tar shard")
        return [root]
    if not root.is_dir():
        raise DatasetError(f"input {root} does not exist")
    names = [p for p in sorted(root.iterdir()) if p.is_file() and not p.name.startswith(".")]
    tars = [p for p in names if p.suffix == ".tar"]
    if tars and len(tars) != len(names):
        other = next(p for p in names if p.suffix != ".tar")
        raise DatasetError(f"input {root} holds both .tar shards and other files ({other.name}): give a folder of "
                           "one kind")
    return tars or None


def tar_samples(shards: list[Path], field_map: dict[str, str]) -> Iterator[tuple[str, dict[str, RawFile]]]:
    """The samples of WebDataset shards, in order (a sample's files are adjacent members)."""
    seen: set[str] = set()
    skipped: set[str] = set()  # suffixes left out, for the message when nothing is left
    key, files = None, {}
    for shard in shards:
        try:
            with tarfile.open(shard, "r|*") as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    k, suffix, field, ext = _member_field(member.name, field_map)
                    if field is None:
                        if len(skipped) < 8:
                            skipped.add(suffix)
                        continue
                    label = f"{shard.name}:{member.name}"
                    if k != key:
                        if key is not None:
                            yield key, files
                        if k in seen:
                            raise DatasetError(f"{label}: sample '{k}' appears twice (its files must be adjacent, "
                                               "as WebDataset writes them)")
                        seen.add(k)
                        key, files = k, {}
                    if field in files:
                        raise DatasetError(f"{label}: sample '{k}' has two files for field '{field}'")
                    files[field] = RawFile(ext, tar.extractfile(member).read(), label)
        except tarfile.TarError as e:
            raise DatasetError(f"{shard}: not a readable tar shard ({e})") from None
    if key is None:
        raise DatasetError(f"input shards {[s.name for s in shards]} hold no sample files"
                           + (f" with a suffix of --field-map ({', '.join(field_map)}; their suffixes: "
                              f"{', '.join(sorted(skipped))})" if field_map else ""))
    yield key, files


def _member_field(name: str, field_map: dict[str, str]) -> tuple[str, str, str | None, str]:
    """(key, suffix, field or None to leave the member out, decoding extension) of a WebDataset member name."""
    folder, _, base = name.rpartition("/")
    stem, dot, suffix = base.partition(".")
    key = (folder.replace("/", "_") + "_" if folder else "") + stem
    if not stem or not dot:
        raise DatasetError(f"member '{name}' is not <key>.<suffix>")
    suffix = suffix.lower()
    if field_map:
        field = field_map.get(suffix)
        ext = suffix.rsplit(".", 1)[-1]
    else:
        field, _, ext = suffix.rpartition(".")
        if not field:
            raise DatasetError(f"member '{name}' is not <key>.<field>.<ext> (give --field-map SUFFIX=FIELD for "
                               "WebDataset names such as 000001.jpg)")
        if "." in field:
            raise DatasetError(f"member '{name}': field '{field}' has a dot")
    if field is not None:
        _check_ext(ext, name)
    return key, suffix, field, ext


def _check_ext(ext: str, where: str) -> None:
    if ext not in KNOWN_EXTS:
        raise DatasetError(f"{where}: unsupported extension .{ext} (supported: {', '.join(KNOWN_EXTS)})")
