"""scripts/setup.sh's check that set-up is done for this Python and this checkout: draftsmith
imports from ./src, torch and triton import, and the default target (argv[1], NAME==VERSION) is
installed at that version. Prints the environment and the Python's version (set-up's stamp
keeps them: python and python3 of one venv are one); exits 1 with why if not."""

import os
import sys
from importlib import metadata


def main() -> str:
    import torch  # noqa: F401
    import triton  # noqa: F401

    import draftsmith

    here = os.path.realpath("src/draftsmith")
    got = os.path.realpath(os.path.dirname(draftsmith.__file__))
    if got != here:
        sys.exit(f"draftsmith imports from {got}, not from this checkout ({here})")
    name, version = sys.argv[1].split("==")
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        have = None
    if have != version:
        sys.exit(f"{name} is {'at ' + have if have else 'not installed'}, not {version}")
    return f"{sys.prefix} (Python {sys.version_info[0]}.{sys.version_info[1]})"


if __name__ == "__main__":
    print(main())
