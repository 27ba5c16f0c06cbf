"""How to install what an optional feature needs, said as a command that works from where the user is.

`pip install 'transformer[data]'` asks the package index for a distribution named transformer, which is
not this package, so a hint names, from a checkout (a source tree, or an editable install of one), the
checkout's extra (`pip install -e '.[data]'`, or `make install` for every extra); from an installed wheel,
the packages themselves (`pip install datasets pyarrow`), as the wheel's metadata lists them for the extra.
A leaf module: the data readers, the exporters and the trackers ask it."""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, requires
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# pyproject.toml's extras but dev, by the names a plain `pip install` takes (tested against it): what a
# hint names where no metadata is installed to list them
EXTRAS = {
    "data": ("datasets", "pyarrow"),
    "export": ("ctranslate2",),
    "hf": ("transformers",),
    "mlflow": ("mlflow-skinny", "sqlalchemy", "alembic"),
    "wandb": ("wandb",),
}


def checkout() -> Path | None:
    """The source tree this package is imported from (its pyproject.toml names the project), or None for an
    installed wheel."""
    pyproject = PACKAGE_DIR.parent / "pyproject.toml"
    try:
        text = pyproject.read_text(encoding="utf-8")
    except OSError:
        return None
    return pyproject.parent if re.search(r'^name = "transformer"', text, re.M) else None


def extra_packages(extra: str) -> list[str]:
    """The distributions this package's installed metadata lists for `extra` (their names only), or where
    it lists none (never installed) those of `EXTRAS`."""
    try:
        listed = requires("transformer") or []
    except PackageNotFoundError:
        listed = []
    names = [
        re.match(r"[A-Za-z0-9._-]+", requirement)[0]
        for requirement in listed
        if re.search(rf"""extra\s*==\s*["']{re.escape(extra)}["']""", requirement)
    ]
    return names or list(EXTRAS[extra])


def install_hint(extra: str) -> str:
    """The command that installs `extra` (a key of `EXTRAS`): `pip install -e '.[extra]'` in a checkout
    (with its path when the working directory is elsewhere), else `pip install PACKAGE ...`."""
    root = checkout()
    if root is None:
        return "pip install " + " ".join(extra_packages(extra))
    here = Path.cwd().resolve() == root
    target = f"'.[{extra}]'" if here else f"'{root}[{extra}]'"
    return f"pip install -e {target} (or make install{'' if here else f' in {root}'}: every extra)"


def upgrade_hint() -> str:
    """How to get a newer version of this package: update the checkout and reinstall it, or install a newer
    release (`pip install -U transformer` would ask the index for another project)."""
    root = checkout()
    if root is None:
        return "install a newer release"
    return f"update the checkout {root} (git pull) and reinstall it (pip install -e . or make install)"
