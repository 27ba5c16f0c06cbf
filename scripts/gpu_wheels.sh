#!/usr/bin/env bash
# What `scripts/gpu_check.sh onmt` installs on a lent GPU machine, which has PyTorch but no package index:
# OpenNMT-py 3.5.1 and the packages it needs beside the machine's torch, as wheels in .gpu/wheels/.
#   bash scripts/gpu_wheels.sh            # here, with a network: downloads them (about 10 MB for Python 3.12)
# OpenNMT-py 3.5.1 pins torch<2.3 but trains on newer ones: it goes in with --no-deps, and of its needs only
# those below (spacy and fasttext are imported by transforms the comparison does not use: the stage puts empty
# stand-ins on PYTHONPATH; ctranslate2, flask and waitress by conversion and the server only).
# PYVER (default 3.12, the lent machines' python3) picks the wheels' Python; DEST (default .gpu/wheels) the
# folder. Also fills, where missing, what the other stages read from .gpu/ (development.md, "On a GPU"):
# .gpu/site (hydra, omegaconf, antlr4, sacremoses, py3langid copied from .venv) and .gpu/multi30k (from
# $MULTI30K_DIR). Check that git ignores .gpu/ (`git check-ignore .gpu/x`): the device call carries it.
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PYVER=${PYVER:-3.12}
DEST=${DEST:-.gpu/wheels}
PY=${PY:-$ROOT/.venv/bin/python}
# one version of each (two of one package stop a --no-index install)
WHEELS="OpenNMT-py==3.5.1 ConfigArgParse==1.7.1 PyYAML==6.0.2 sacrebleu==2.5.1 six==1.17.0 tensorboard==2.20.0
        sentencepiece==0.2.1 pyonmttok==1.38.1 rapidfuzz==3.13.0 pyahocorasick==2.2.0"
mkdir -p "$DEST"
platforms=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux1_x86_64; do
    platforms="$platforms --platform $p"
done
for wheel in $WHEELS; do
    # shellcheck disable=SC2086
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
        $platforms -d "$DEST" "$wheel"
done
ls -la "$DEST"
du -sh "$DEST"

if [ ! -d .gpu/site/hydra ]; then   # the pure-Python packages the machine lacks, from this checkout's venv
    site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    mkdir -p .gpu/site
    for package in hydra omegaconf antlr4 sacremoses py3langid; do
        cp -r "$site/$package" .gpu/site/
    done
    echo "filled .gpu/site from $site"
fi
if [ ! -f .gpu/multi30k/train.de ] && [ -n "${MULTI30K_DIR:-}" ] && [ -f "$MULTI30K_DIR/train.de" ]; then
    mkdir -p .gpu/multi30k
    cp -r "$MULTI30K_DIR"/. .gpu/multi30k/
    echo "filled .gpu/multi30k from $MULTI30K_DIR"
fi
git check-ignore -q .gpu/wheels 2>/dev/null \
    || echo "WARNING: git does not ignore .gpu/: add /.gpu/ to .gitignore (or .git/info/exclude) before carrying it"
