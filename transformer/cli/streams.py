"""transformer-translate's input and output: lines read whole or in chunks as they arrive (a pipe, a
terminal), invalid UTF-8 replaced and counted, output written and flushed to a file or stdout, a reader
that went away (`| head`) taken as the end."""

from __future__ import annotations

import os
import queue
import stat
import sys
import threading

from transformer.errors import (
    UsageError,
    discard_stdout,
)


def text_line(raw: bytes) -> tuple[str, bool]:
    """One input line (without its line break) as text; whether it was invalid UTF-8 (bytes replaced)."""
    raw = raw[:-1] if raw.endswith(b"\r") else raw
    try:
        line, bad = raw.decode("utf-8"), False
    except UnicodeDecodeError:
        line, bad = raw.decode("utf-8", errors="replace"), True
    # Control characters other than tab carry no meaning for translation.
    return "".join(ch if ch >= " " or ch == "\t" else " " for ch in line), bad


# The longest input line taken, in bytes: a sentence is far shorter; a file without line breaks (a binary
# file, a device) would otherwise be read whole into memory as one line.
MAX_LINE_BYTES = 1 << 20


def bounded_lines(stream, where: str, max_line_bytes: int):
    """The raw lines of a binary stream, line breaks kept, read one at a time; a line longer than
    `max_line_bytes` is a UsageError naming `where` and the line."""
    for number, raw in enumerate(iter(lambda: stream.readline(max_line_bytes + 1), b""), start=1):
        if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
            raise UsageError(
                f"{where}: line {number} is longer than {max_line_bytes:,} bytes; give one sentence per line "
                "(is it a text file?)"
            )
        yield raw


def read_input(stream, where: str = "stdin", max_line_bytes: int = MAX_LINE_BYTES) -> tuple[list[str], int]:
    """Lines of a binary stream decoded as UTF-8 (invalid bytes replaced); also the count of bad lines.
    A line longer than `max_line_bytes` is a UsageError naming `where` and the line."""
    decoded = []
    for number, raw in enumerate(bounded_lines(stream, where, max_line_bytes), start=1):
        if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        decoded.append(text_line(raw[:-1] if raw.endswith(b"\n") else raw))
    return [line for line, _ in decoded], sum(bad for _, bad in decoded)


# At most this many lines are translated together while streaming.
STREAM_CHUNK_LINES = 256


def stream_chunks(stream, max_lines: int = STREAM_CHUNK_LINES, max_line_bytes: int = MAX_LINE_BYTES):
    """Lines of a binary stream in chunks as they arrive: (lines, invalid UTF-8 count) per chunk.

    A reader thread queues lines as they come in (and what stopped it: an error there is raised here, as a
    UsageError, never taken for the end of the input); each chunk waits for one line, then takes whatever
    else has already arrived. At a terminal that is one line at a time; from a pipe fed faster than
    the model translates, chunks grow to `max_lines`, so a long-running filter keeps batching.
    """
    # Bounded: a producer far faster than the model waits instead of queueing its whole input in memory.
    arrived: queue.Queue = queue.Queue(maxsize=4 * max_lines)

    def read() -> None:
        try:
            for raw in bounded_lines(stream, "stdin", max_line_bytes):
                arrived.put(raw)
        except Exception as error:  # handed to the consumer: one error line, never taken for the end
            arrived.put(error)
        finally:
            arrived.put(None)  # end of input

    threading.Thread(target=read, name="translate-input", daemon=True).start()
    first, ended = True, False
    while not ended:
        raw = arrived.get()
        if raw is None:
            return
        if isinstance(raw, Exception):
            raise _input_error(raw)
        chunk = [raw]
        while len(chunk) < max_lines:
            try:
                raw = arrived.get_nowait()
            except queue.Empty:
                break
            if isinstance(raw, Exception):
                raise _input_error(raw)
            if raw is None:
                ended = True
                break
            chunk.append(raw)
        if first and chunk[0].startswith(b"\xef\xbb\xbf"):
            chunk[0] = chunk[0][3:]
        first = False
        decoded = [text_line(raw[:-1] if raw.endswith(b"\n") else raw) for raw in chunk]
        yield [line for line, _ in decoded], sum(bad for _, bad in decoded)


def _input_error(error: Exception) -> Exception:
    """What the reader thread met, as the command says it: an OSError and a refusal as they are (the
    command names them), anything else (MemoryError, ...) as a UsageError that names it."""
    if isinstance(error, (OSError, UsageError)):
        return error
    return UsageError(f"reading the input: {type(error).__name__}{': ' + str(error) if str(error) else ''}")


def fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # closed, or replaced by one without a descriptor
        return None


def arrives_as_a_stream(stdin) -> bool:
    """Translate as input arrives when it comes from a pipe or a terminal; a redirected file is read whole
    (one sorted pass batches best)."""
    try:
        return not stat.S_ISREG(os.fstat(stdin.fileno()).st_mode)
    except (OSError, ValueError, AttributeError):
        return False


def format_results(results, nbest: int, first_index: int) -> str:
    if nbest == 1:
        return "".join(one_line(hyps[0][0]) + "\n" for hyps in results)
    return "".join(
        f"{index}\t{score:.4f}\t{one_line(text)}\n"
        for index, hyps in enumerate(results, start=first_index)
        for text, score in hyps
    )


def warn_invalid(bad: int) -> None:
    if bad:
        print(
            f"transformer-translate: warning: {bad} input line(s) were not valid UTF-8; invalid bytes were replaced",
            file=sys.stderr,
        )


def write_output(text: str, output: str | None) -> int:
    """All the output at once, to the --output file or stdout; the exit code."""
    try:
        out = open(output, "w", encoding="utf-8") if output else None
    except OSError as error:
        raise UsageError(f"--output {output}: {error.strerror}") from None
    try:
        return send(text, out, output) or 0
    finally:
        close_output(out)


def send(text: str, out, output: str | None) -> int | None:
    """Write and flush `text` to the open --output file `out`, or to stdout (`out` None). None when it
    was written; 0 when the reader went away (`| head`); a UsageError when it could not be written (a
    full disk, ...)."""
    try:
        if out is not None:
            out.write(text)
            out.flush()
        else:
            sys.stdout.buffer.write(text.encode("utf-8"))
            sys.stdout.flush()
        return None
    except OSError as error:
        if out is None:  # what stdout still holds would fail again at exit, with a traceback
            discard_stdout()
        if isinstance(error, BrokenPipeError):
            return 0
        where = f"--output {output}" if out is not None else "stdout"
        raise UsageError(f"{where}: cannot write the output: {error.strerror or error}") from None


def close_output(out) -> None:
    if out is not None:
        try:
            out.close()
        except OSError:  # a failed write, already reported: closing retries its flush
            pass


def one_line(text: str) -> str:
    # A translation must never add line breaks, or the output would no longer align with the input.
    return text.replace("\r", " ").replace("\n", " ")
