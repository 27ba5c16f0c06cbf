# `make help` lists the targets. Every target creates or refreshes .venv from pyproject.toml itself.
# Anything after a target that looks like key=value (or +key=value, ~key) is passed to Hydra unchanged
# ($ and spaces included; quote such values for your shell); Hydra's own flags go in ARGS:
#   make train model=small data=multi30k_de_en trainer.max_steps=500
#   make train data=custom data.path=DIR ARGS="--config-dir my_presets"

PYTHON ?= python3
# The exact torch every `make` installs (the package itself accepts torch >= 2.11): a CPU wheel here.
TORCH  ?= torch==2.13.0
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
NPROC  ?= 2
split  ?= test
# pytest workers of `make test` / `make test-fast` (pytest-xdist), one thread each; 0: one process, two threads
TEST_WORKERS ?= 2

# Make's own variables and the targets are not Hydra overrides; everything else on the command line is.
OWN_VARS    := NPROC CKPT split PYTHON TORCH ARGS TEST_WORKERS
TARGETS     := help install prepare train sweep train-ddp evaluate translate tensorboard test test-fast bench lint clean
empty       :=
space       := $(empty) $(empty)
# MAKEOVERRIDES escapes a space inside a value as "\ " and doubles "$": keep each override one word
# while make's own variables are filtered out, then hand the shell "\ " and "\$" so that both reach
# Hydra unchanged (hydra.run.dir='runs/${now:%H}' stays a Hydra interpolation).
# MAKEOVERRIDES lists the command line's variables last first: reversed, Hydra gets them in the order typed
# (it applies them in order; .hydra/overrides.yaml and the resume command show them so). Words without
# '=' (~key) are make goals: they follow the key=value ones.
reverse      = $(if $(1),$(call reverse,$(wordlist 2,$(words $(1)),$(1))) $(firstword $(1)))
HYDRA_ARGS  := $(subst \$(space),@SPACE@,$(MAKEOVERRIDES))
HYDRA_ARGS  := $(strip $(call reverse,$(filter-out $(foreach v,$(OWN_VARS),$(v)=%),$(HYDRA_ARGS)))) \
               $(filter-out $(TARGETS),$(MAKECMDGOALS))
HYDRA_ARGS  := $(subst @SPACE@,\$(space),$(subst $$$$,\$$,$(HYDRA_ARGS))) $(subst $$,\$$,$(value ARGS))

.PHONY: $(TARGETS)
.DEFAULT_GOAL := help

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check '$(TORCH)' -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)  ## create/refresh .venv (torch pinned by TORCH above)

prepare: $(STAMP)  ## SentencePiece + memory-mapped encoded corpus for the data config (train does it when missing)
	$(PY) -m transformer.cli.prepare $(HYDRA_ARGS)

train: $(STAMP)  ## train; key=value args are Hydra overrides (default: tiny model on the embedded corpus)
	$(PY) -m transformer.cli.train $(HYDRA_ARGS)

sweep: $(STAMP)  ## one training job per combination: make sweep trainer.lr=1e-3,5e-4 (summary in runs/sweeps/)
	$(PY) -m transformer.cli.train --multirun $(HYDRA_ARGS)

train-ddp: $(STAMP)  ## train with torchrun on NPROC processes (NPROC=2 by default)
	$(PY) -m transformer.cli.launch --standalone --nproc_per_node=$(NPROC) $(HYDRA_ARGS)

evaluate: $(STAMP)  ## BLEU/chrF of CKPT=path on split=test (writes hypotheses and scores beside CKPT)
	@test -n "$(CKPT)" || { echo "usage: make evaluate CKPT=runs/.../checkpoints/best.pt [split=test]"; exit 2; }
	$(PY) -m transformer.cli.evaluate $(CKPT) --split $(split) $(ARGS)

translate: $(STAMP)  ## translate stdin to stdout with CKPT=path (beam 5)
	@test -n "$(CKPT)" || { echo "usage: make translate CKPT=path < in.txt > out.txt"; exit 2; }
	@$(PY) -m transformer.cli.translate $(CKPT) $(ARGS)

tensorboard: $(STAMP)  ## serve TensorBoard for runs/
	$(VENV)/bin/tensorboard --logdir runs

test: $(STAMP)  ## install everything from nothing, then run the test suite (TEST_WORKERS=2 processes)
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests

test-fast: $(STAMP)  ## the tests without the end-to-end training runs
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow" tests

bench: $(STAMP)  ## speed/memory benchmark: writes bench.json and prints a table
	$(PY) scripts/bench.py $(ARGS)

lint: $(STAMP)  ## ruff check and ruff format --check (CI runs it beside the tests)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:  ## remove .venv, caches and data/ (tokenizers, prepared corpora; keeps runs/)
	rm -rf $(VENV) .pytest_cache .ruff_cache data/spm data/cache data/corpus data/.prepare.*.lock

# Hydra's "~key" deletions look like goals to make: accept and ignore them as goals.
~%:
	@:
