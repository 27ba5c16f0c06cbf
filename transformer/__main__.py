"""`python -m transformer`: the package's commands, a line each (`--version`: the version). Each command
also runs as `python -m MODULE` where its console script is not on PATH. Nothing here imports torch."""

from __future__ import annotations

import sys

# (console script, the module `python -m` runs, what it does): pyproject.toml's [project.scripts] (tested)
COMMANDS = (
    ("transformer-train", "transformer.train", "train a model (KEY=VALUE overrides; --help lists every key)"),
    ("transformer-train-ddp", "transformer.cli.launch", "train on several processes or GPUs (torchrun)"),
    ("transformer-prepare", "transformer.cli.prepare", "train the tokenizer and encode the corpus, no training"),
    ("transformer-translate", "transformer.cli.translate", "translate lines with a checkpoint (or an ensemble)"),
    ("transformer-evaluate", "transformer.cli.evaluate", "sacreBLEU and chrF of a checkpoint on a split"),
    ("transformer-average", "transformer.cli.average", "average the weights of checkpoints into one"),
    ("transformer-export", "transformer.cli.export", "export a checkpoint: safetensors directory, CTranslate2"),
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--version" in argv:
        from transformer.cli.args import version_line

        print(version_line())
        return 0
    width = max(len(name) for name, _, _ in COMMANDS)
    lines = ["The commands (each takes --help and --version):"]
    lines += [f"  {name:<{width}}  {what}" for name, _, what in COMMANDS]
    lines += ["Where they are not on PATH: python -m transformer.train, or python -m transformer.cli.NAME"]
    lines += ["  with NAME one of " + ", ".join(module.split(".")[-1] for _, module, _ in COMMANDS[1:])]
    print("\n".join(lines))
    if argv and not {"-h", "--help"} & set(argv):
        print(f"python -m transformer: {argv[0]!r} is not an option; run one of the commands above", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
