"""test_results.json: the scores of the test at the end of training, in the run directory, for the model
card of an export of the checkpoint that was tested (the checkpoint itself is written before the test)."""

from __future__ import annotations

import json
from pathlib import Path

TEST_RESULTS_FILE = "test_results.json"


def write_test_results(run_dir: Path, checkpoint: Path | None, step: int | None, details: dict, scores: dict) -> None:
    """Write the test's `scores` (sacreBLEU's BLEU and chrF with their signatures) for `checkpoint` (the
    file tested, None for the final weights) at `step`; `details`: the split, sentences, beam, languages.
    The checkpoint's name is relative to the run directory: no path of this machine goes into a card."""
    record = {
        "checkpoint": checkpoint.relative_to(run_dir).as_posix() if checkpoint is not None else None,
        "step": step,
        **details,
        **{key: scores[key] for key in ("bleu", "chrf", "bleu_signature", "chrf_signature") if key in scores},
    }
    (run_dir / TEST_RESULTS_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def test_results_for(checkpoint: str | Path, step: int | None) -> dict | None:
    """The test results of the run that `checkpoint` (RUN/checkpoints/NAME.pt) belongs to, if that file at
    that `step` is the one tested; else None (another checkpoint, an older test, none at all)."""
    path = Path(checkpoint)
    if path.parent.name != "checkpoints":
        return None
    try:
        record = json.loads((path.parent.parent / TEST_RESULTS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("bleu"), (int, float)):
        return None
    if record.get("checkpoint") != f"checkpoints/{path.name}" or step is None or record.get("step") != step:
        return None
    return record
