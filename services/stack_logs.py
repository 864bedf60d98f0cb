"""The replicas' errors, read back from a Ray session's log files (stdlib only: the benches
import it without the stack). The GPU stack runs Ray with log_to_driver off (the replicas' logs
would flood the launcher's output), so a request that failed inside a replica ("INTERNAL:
internal server error (request id ...)") leaves its cause only in the session's log files;
`error_excerpts` collects it and `write_excerpts` keeps it beside a bench's results."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile

# a traceback, an ERROR record, an exception's text, or the router's note of what an INTERNAL
# answer hid from the client (services/router/validation.py `public_message`)
ERROR_LINE = re.compile(
    r"Traceback \(most recent call last\)|\bERROR\b|\b[A-Z]\w*(Error|Exception): |answered with a generic message"
)
RECORD_START = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")  # a new log record ends an excerpt
EXCERPT_LINES = 30


def ray_logs_dir() -> str:
    """The logs folder of the newest Ray session on this machine (Ray's default temp root, or
    $RAY_TMPDIR)."""
    root = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
    return os.path.join(root, "ray", "session_latest", "logs")


def error_excerpts(logs_dir: str, *, max_bytes: int = 200_000, since_unix: float | None = None) -> list[str]:
    """Excerpts of the error lines in a Ray session's replica and worker logs (`serve/*.log`,
    `worker-*.err`, `worker-*.out`): each matching line and the lines after it up to the next log
    record (at most EXCERPT_LINES), headed by its file; identical excerpts (the same failure over many requests) once, with a count; at
    most `max_bytes` in all. Files not modified since `since_unix` are skipped. A missing
    folder gives []."""
    paths: list[str] = []
    for sub, pattern in (("serve", re.compile(r".*\.log$")), ("", re.compile(r"worker-.*\.(err|out)$"))):
        folder = os.path.join(logs_dir, sub)
        with contextlib.suppress(OSError):
            paths += [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if pattern.match(n)]
    seen: dict[str, int] = {}
    order: list[tuple[str, str]] = []
    for path in paths:
        try:
            if since_unix is not None and os.path.getmtime(path) < since_unix:
                continue
            with open(path, errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        i = 0
        while i < len(lines):
            if ERROR_LINE.search(lines[i]):
                j = i + 1
                while j < min(len(lines), i + 1 + EXCERPT_LINES) and not RECORD_START.match(lines[j]):
                    j += 1
                body = "\n".join(lines[i:j])
                key = re.sub(r"[0-9a-f]{32}|\d+", "#", body)  # ids, times, pids: one failure
                if key not in seen:
                    order.append((key, f"--- {os.path.basename(path)}\n{body}"))
                seen[key] = seen.get(key, 0) + 1
                i = j
            else:
                i += 1
    out, size = [], 0
    for key, text in order:
        text = text if seen[key] == 1 else f"{text}\n(x{seen[key]})"
        if size + len(text) > max_bytes:
            out.append(f"... {len(order) - len(out)} more excerpts left out (max_bytes {max_bytes})")
            break
        out.append(text)
        size += len(text)
    return out


SERVER_ERRORS_FILE = "server_errors.log"


def write_excerpts(excerpts: list[str], path: str | os.PathLike) -> None:
    """`error_excerpts`' output as one file (folders made), nothing when there are none."""
    if excerpts:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            f.write("\n\n".join(excerpts) + "\n")
