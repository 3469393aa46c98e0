"""`scorefn batch merge INPUT OUTPUT [SHARD_FILE ...]`: the shards' records as one file in input order.

Without SHARD_FILEs it takes every OUTPUT.shard-IIIII-of-NNNNN beside OUTPUT. The merged file is written whole
and then renamed over OUTPUT. Lines that no shard answered are named (they are left out; re-run their shard).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from handler.batch.lines import Key, keys
from handler.batch.records import scan_records
from handler.batch.shards import SHARD_FILE

_NAMED = 20  # missing lines named in the summary


class MergeError(Exception):
    """The files cannot be merged (the message says why); OUTPUT is left as it was."""


@dataclasses.dataclass(frozen=True)
class Merged:
    lines: int
    written: int
    missing: list[Key]
    shard_files: list[Path]

    def summary(self) -> dict:
        return {"lines": self.lines, "written": self.written, "missing": len(self.missing),
                "missing_custom_ids": [str(key) if isinstance(key, str) else f"line {key}"
                                       for key in self.missing[:_NAMED]],
                "shard_files": [str(path) for path in self.shard_files]}


def shard_files(output: Path) -> list[Path]:
    """The shard files beside OUTPUT, all of one job (one shard count)."""
    found = sorted(path for path in output.parent.glob(f"{output.name}.shard-*") if SHARD_FILE.search(path.name))
    counts = {SHARD_FILE.search(path.name)[2] for path in found}
    if len(counts) > 1:
        raise MergeError(f"shard files of different shard counts ({', '.join(sorted(counts))}) beside {output}: "
                         "name the files to merge")
    if not found:
        raise MergeError(f"no shard files {output.name}.shard-*-of-* in {output.parent or '.'}")
    return found


def merge(input_path: Path, output: Path, files: list[Path] | None = None) -> Merged:
    files = files or shard_files(output)
    order = keys(input_path)
    expected = set(order)
    where: dict[Key, tuple[Path, int, int]] = {}
    for path in files:
        try:
            found, _ = scan_records(path)
        except (OSError, ValueError) as exc:
            raise MergeError(str(exc)) from None
        strangers = found.keys() - expected
        if strangers:
            raise MergeError(f"{path} answers lines {input_path} does not have (e.g. "
                             f"{sorted(map(str, strangers))[0]!r}): is it another job's output?")
        for key, (offset, length) in found.items():
            where.setdefault(key, (path, offset, length))
    partial = output.with_name(output.name + ".merging")
    readers = {path: open(path, "rb") for path in files}
    try:
        with open(partial, "wb") as file:
            for key in order:
                if key in where:
                    path, offset, length = where[key]
                    readers[path].seek(offset)
                    file.write(readers[path].read(length))
            file.flush()
            os.fsync(file.fileno())
    finally:
        for reader in readers.values():
            reader.close()
    os.replace(partial, output)
    return Merged(len(order), len(where), [key for key in order if key not in where], files)
