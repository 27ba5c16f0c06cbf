"""`transformer-prepare key=value ...` (`make prepare`): the tokenizer and every split, without training."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from transformer.cli.run import run_command
from transformer.console import set_quiet
from transformer.data.sources import DataError, open_split

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    """`transformer-prepare key=value ...` (`make prepare`): composes the same Hydra config as training,
    with the same arguments (--config-dir DIR, --cfg job, --help), makes no run directory, and prepares
    the tokenizer and every split."""
    # The log on stdout (as Hydra's for training), so that stderr holds nothing but an error line.
    logging.basicConfig(
        level=logging.INFO, stream=sys.stdout, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
    )
    code = run_command(
        None,
        lambda: _prepare(sys.argv[1:] if argv is None else argv),
        interrupted="interrupted: preparation stopped; what was finished is kept, nothing half-written is left "
        "(run it again to finish)",
    )
    if code:
        sys.exit(code)


def _prepare(argv: list[str]) -> None:
    from transformer.cli.hydra_args import command_line_config, quiet_as_override

    cfg = command_line_config(quiet_as_override(list(argv)), "transformer-prepare")
    if cfg is None:  # it printed the help, the version or the composed config
        return
    if cfg.trainer.log_level:  # as training honours it (run_log.py), here over basicConfig's INFO
        logging.getLogger("transformer").setLevel(cfg.trainer.log_level.upper())
        set_quiet(cfg.trainer.log_level in ("warning", "error"))
    from transformer.data.prepare import prepare  # torch comes with the mixture's batches

    splits = ("validation",) if cfg.data.corpora else ("train", "validation")  # a mixture: its corpora
    sources = {split: open_split(cfg.data, split) for split in splits}
    try:
        sources["test"] = open_split(cfg.data, "test")
    except DataError as error:
        log.warning("no test split to prepare: %s", error)
    prepared = prepare(cfg.data, sources=sources)
    print(
        f"prepared {cfg.data.name}: {len(prepared.train)} training pairs, vocabulary "
        f"{prepared.tokenizer.src_vocab_size} pieces, in {Path(cfg.data.cache_dir).resolve()}",
        flush=True,
    )


if __name__ == "__main__":
    main()
