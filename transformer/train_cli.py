"""`transformer-train`'s front door: `--help` (with or without overrides and --config-dir) is composed
and printed here, without torch (about 2.5 s of every start); everything else goes to Hydra and the
training (`transformer.train.main`), whose --help prints the same text."""

from __future__ import annotations

import sys

from transformer.config import ConfigError, command_line_config
from transformer.errors import discard_stdout


def main() -> None:
    argv = sys.argv[1:]
    if {"--help", "-h"} & set(argv):
        try:
            if command_line_config(argv, "transformer-train") is None:      # it printed the help
                return
        except ConfigError:      # something only Hydra takes (--multirun, --config-name, ...): Hydra's help
            pass
        except BrokenPipeError:  # `transformer-train --help | head`
            discard_stdout()
            return
    from transformer.train import main as train_main

    train_main()


if __name__ == "__main__":
    main()
