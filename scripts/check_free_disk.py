"""Stop the GPU suite before it starts when the disk is too full for it, and say what to delete.

    python scripts/check_free_disk.py GIB [FOLDER ...]

Half 2 of ``make test-gpu`` writes 8B-shaped checkpoints and merged exports (tens of GiB at once over its
workers): on the H200 machine it ran out of space with 49 GiB free (session 26, the MoE benchmark
checkpoints left from earlier calls) and with the 8B decode checkpoint left (session 25), and passed with
64 GiB free. With less than ``GIB`` free here this exits 1 and lists the sizes of ``FOLDER``s (the
benchmarks' random-weight checkpoints, rebuilt on demand; an earlier pytest run's temporary folders), so the fix is
one ``rm -rf``.
"""

from __future__ import annotations

import os
import shutil
import sys


def folder_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def main() -> int:
    need = float(sys.argv[1])
    free = shutil.disk_usage(os.getcwd()).free / 2**30
    if free >= need:
        print(f"disk: {free:.1f} GiB free (the GPU suite needs about {need:.0f})")
        return 0
    print(f"disk: only {free:.1f} GiB free; the GPU suite needs about {need:.0f} GiB (8B checkpoints and exports) "
          "and would fail with 'No space left on device'.", file=sys.stderr)
    for folder in sys.argv[2:]:
        if os.path.isdir(folder):
            what = ("an earlier pytest run's temporary folders" if "pytest-of-" in folder
                    else "random-weight benchmark checkpoints, rebuilt on demand")
            print(f"  {folder}: {folder_bytes(folder) / 2**30:.1f} GiB ({what}): rm -rf {folder}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
