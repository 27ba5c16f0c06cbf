"""`pip install .` works outside a source checkout: build the wheel, install it into a fresh virtual
environment, and train and translate from a directory that has no conf/ and no source beside it.

No network: the wheel is built without build isolation, and the new environment reaches the already
installed dependencies (torch, hydra, ...) through a path entry rather than downloading them."""

import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.helpers import FAST, ROOT
from transformer.checkpoint import load_checkpoint


def _run(*args, cwd, timeout=300):
    proc = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.mark.slow
def test_the_wheel_installs_and_trains_outside_the_checkout(tmp_path):
    # Build from a copy, so that the checkout gets no build/ directory.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "transformer", source / "transformer", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    _run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--quiet",
        "-w",
        dist,
        source,
        cwd=tmp_path,
    )
    (wheel,) = dist.glob("transformer-*.whl")
    shutil.rmtree(source)

    env_dir = tmp_path / "env"
    _run(sys.executable, "-m", "venv", env_dir, cwd=tmp_path)
    python = env_dir / "bin" / "python"
    env_site = Path(
        _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path).strip()
    )
    # The dependencies: this environment's site-packages as a plain path entry (its .pth files, among
    # them the editable install of this checkout, are not processed that way).
    dependencies = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    (env_site / "dependencies.pth").write_text("\n".join(dict.fromkeys(dependencies)) + "\n")
    _run(python, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", wheel, cwd=tmp_path)

    work = tmp_path / "elsewhere"
    work.mkdir()
    where = _run(
        python,
        "-c",
        "import transformer, transformer.config as c; print(transformer.__file__); print(c.CONF_DIR)",
        cwd=work,
    ).split()
    assert all(Path(p).is_relative_to(env_site) for p in where), where
    assert (Path(where[1]) / "config.yaml").is_file() and (Path(where[1]) / "data" / "custom.yaml").is_file()

    _run(
        env_dir / "bin" / "transformer-train",
        *FAST,
        "trainer.max_steps=2",
        "trainer.validate_every=2",
        "trainer.test_at_end=false",
        "data.embedded_pairs=300",
        "hydra.run.dir=run",
        cwd=work,
    )
    checkpoint = work / "run" / "checkpoints" / "last.pt"
    assert checkpoint.is_file() and (work / "data" / "spm").is_dir()  # relative paths: the working directory
    # the torchrun front door is installed too: one rank continues the run
    _run(
        env_dir / "bin" / "transformer-train-ddp",
        "--standalone",
        "--nproc_per_node=1",
        *FAST,
        "trainer.max_steps=4",
        "trainer.validate_every=2",
        "trainer.test_at_end=false",
        "data.embedded_pairs=300",
        "trainer.resume=true",
        "hydra.run.dir=run",
        cwd=work,
    )
    assert load_checkpoint(checkpoint)["step"] == 4
    proc = subprocess.run(
        [str(env_dir / "bin" / "transformer-translate"), str(checkpoint), "--beam", "2"],
        input="Der Hund.\nDie Katze.\n",
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 2, proc.stderr
