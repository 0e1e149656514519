"""`convert --overwrite`: the output folder's old contents deleted in the background.

Deleting a finished GLM-5.2 output (420 GiB) takes minutes on the disks measured (the
GLM-5.2-shaped slice's 13.5 GB: 3.5-4 s on the H200's disk, BENCHMARKS.md), and the run used
to wait for it before reading its first tensor. Now each old entry is renamed into one folder
inside the output, `TRASH` (a rename within the folder: instant), and a thread deletes that
folder while the conversion runs.

Nothing counts on the space it frees: the disk check (`disk.check_disk`) sees only the space
free at that moment, and where that is too little the run waits for the deletion and checks
again (`Deleting.wait`). The run waits for it before the manifest says complete, so a finished
folder never holds `TRASH`; one left by a killed run is ours and is deleted by the next run in
the folder, with or without --overwrite.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

from quantize.errors import Problem, QuantizeError

__all__ = ["TRASH", "Deleting"]

TRASH = ".quantize-deleting"


class Deleting:
    """Moves `paths` (entries of `out`) into `out/TRASH` and deletes it on a thread.

        deleting = Deleting(out, old_entries)   # returns at once
        ...                                     # the conversion
        deleting.wait()                         # before the folder is declared complete
    """

    def __init__(self, out: Path, paths: list[Path]) -> None:
        self.trash = out / TRASH
        if self.trash.is_symlink() or self.trash.exists() and not self.trash.is_dir():
            _remove(self.trash)  # (a file of that name: among the contents --overwrite deletes)
        self.trash.mkdir(exist_ok=True)
        for i, p in enumerate(q for q in paths if q != self.trash):
            try:  # (the same folder's file system: a rename, no copy)
                os.rename(p, self.trash / f"{os.getpid()}-{i}-{p.name}")
            except OSError:
                _remove(p)  # (not movable: deleted here, its error raised here, as before)
        # (an error here is wait()'s to report: it tries again where the run can still say so)
        self._thread = threading.Thread(target=shutil.rmtree, args=(self.trash,),
                                        kwargs={"ignore_errors": True}, name="quantize-deleting",
                                        daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._thread.is_alive()

    def wait(self) -> None:
        """Block until the old contents are deleted; a deletion that failed is tried once more
        here, then refused by name (a folder holding TRASH must not look complete)."""
        self._thread.join()
        if self.trash.exists():
            try:
                shutil.rmtree(self.trash)
            except OSError as e:
                raise QuantizeError("could not delete the output folder's previous contents", [Problem(
                    str(self.trash), None, f"{type(e).__name__}: {e}",
                    "the files --overwrite moved aside, deleted",
                    "delete that folder by hand (check its permissions), then rerun the command: "
                    "it resumes")]) from None


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink()
