# `make help` lists the targets. Every target creates or refreshes .venv from pyproject.toml itself.
# Anything after a target that looks like key=value (or +key=value, ~key) is passed to Hydra unchanged:
#   make train model=small data=multi30k_de_en trainer.max_steps=500

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
NPROC  ?= 2
split  ?= test

# Make's own variables and the targets are not Hydra overrides; everything else on the command line is.
OWN_VARS    := NPROC CKPT split PYTHON ARGS
TARGETS     := help install prepare train train-ddp evaluate translate tensorboard test test-fast bench lint clean
HYDRA_ARGS  := $(filter-out $(foreach v,$(OWN_VARS),$(v)=%),$(MAKEOVERRIDES)) \
               $(filter-out $(TARGETS),$(MAKECMDGOALS)) $(ARGS)

.PHONY: $(TARGETS)
.DEFAULT_GOAL := help

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)  ## create/refresh .venv (torch pinned in pyproject.toml)

prepare: $(STAMP)  ## SentencePiece + memory-mapped encoded corpus for the data config (train does it when missing)
	$(PY) -m transformer.corpus $(HYDRA_ARGS)

train: $(STAMP)  ## train; key=value args are Hydra overrides (default: tiny model on the embedded corpus)
	$(PY) -m transformer.train $(HYDRA_ARGS)

train-ddp: $(STAMP)  ## train with torchrun on NPROC processes (NPROC=2 by default)
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) -m transformer.train $(HYDRA_ARGS)

evaluate: $(STAMP)  ## BLEU/chrF of CKPT=path on split=test (writes hypotheses and scores beside CKPT)
	@test -n "$(CKPT)" || { echo "usage: make evaluate CKPT=runs/.../checkpoints/best.pt [split=test]"; exit 2; }
	$(PY) -m transformer.evaluate $(CKPT) --split $(split) $(ARGS)

translate: $(STAMP)  ## translate stdin to stdout with CKPT=path (beam 5)
	@test -n "$(CKPT)" || { echo "usage: make translate CKPT=path < in.txt > out.txt"; exit 2; }
	@$(PY) -m transformer.translate $(CKPT) $(ARGS)

tensorboard: $(STAMP)  ## serve TensorBoard for runs/
	$(VENV)/bin/tensorboard --logdir runs

test: $(STAMP)  ## install everything from nothing, then run the test suite
	$(PY) -m pytest -q tests

test-fast: $(STAMP)  ## the tests without the end-to-end training runs
	$(PY) -m pytest -q -m "not slow" tests

bench: $(STAMP)  ## speed/memory benchmark: writes bench.json and prints a table
	$(PY) scripts/bench.py $(ARGS)

lint: $(STAMP)  ## ruff check
	$(VENV)/bin/ruff check .

clean:  ## remove .venv, caches and data/ (tokenizers, prepared corpora; keeps runs/)
	rm -rf $(VENV) .pytest_cache .ruff_cache data/spm data/cache data/corpus data/.prepare.*.lock

# Hydra's "~key" deletions look like goals to make: accept and ignore them as goals.
~%:
	@:
