"""The ``certify`` console script runs the code of the checkout it is run in.

The framework finds the project from the working directory (``certify.files.paths``: the nearest directory
upwards with a ``[tool.certify]`` table), but Python imports ``certify``, and the target's own modules,
from wherever the project was installed. An editable install of one clone, run from inside another
clone, would certify the first clone's code against the second clone's cell files and write the
verdicts into the second clone's receipts. So, before the command imports anything else:

- where the project root has a ``certify`` package of its own and it is not the imported one, the
  command runs again in a fresh interpreter with that root first on the import path
  (``python -P -m certify.checkout ARGS``, ``-P``: the working directory is not prepended): the
  checkout's framework and the checkout's target code run;
- where the fresh interpreter still imports another ``certify`` (something ahead of ``PYTHONPATH`` on
  the import path), the command refuses, naming both directories;
- where the project has no ``certify`` package (a target project using an installed framework), the
  root goes first on the import path, so the target's modules come from the checkout.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import certify
from certify.files.paths import project_paths

RERUN_ENV = "CERTIFY_CHECKOUT_ROOT"  # set in the fresh interpreter: the root it was started for
REFUSED = 2


def imported_package() -> Path:
    """The directory of the ``certify`` package this interpreter imported."""
    return Path(certify.__file__).resolve().parent


def checkout_package(root: Path) -> Path | None:
    """The checkout's own ``certify`` package, where it has one."""
    own = root / "certify"
    return own.resolve() if (own / "__init__.py").is_file() else None


def main(argv: list[str] | None = None) -> int:
    root = project_paths().root.resolve()
    own, imported = checkout_package(root), imported_package()
    if own is not None and own != imported:
        if os.environ.get(RERUN_ENV) == str(root):
            print(f"certify: refusing to run: the project found from the working directory is {root}, "
                  f"whose certify package is {own}, but Python imports the certify package from "
                  f"{imported}. Install this checkout (`pip install -e .` in {root}) or remove what "
                  f"puts {imported.parent} ahead of it on the import path.", file=sys.stderr)
            return REFUSED
        args = sys.argv[1:] if argv is None else list(argv)
        path = os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])
        env = {**os.environ, RERUN_ENV: str(root), "PYTHONPATH": path}
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-P", "-m", "certify.checkout", *args], env)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from certify.cli import main as cli_main  # noqa: PLC0415 (after the import path is settled)

    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
