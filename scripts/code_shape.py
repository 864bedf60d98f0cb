"""The shape of the code at two revisions: what issue 27 measures, as one table per figure.

    python scripts/code_shape.py [--before 7f5b989] [--after HEAD] [--out bench/results/code_shape.md]

Reads each revision's tracked files through git (no checkout; `--after WORKTREE` reads the
working tree instead) and prints / writes:

- code lines (non-blank lines of .py files) per top-level folder, the installed package
  (`flashpd`'s folders, setup.py ROOTS; `bench/results` excluded) and the unpackaged parts apart;
- function length (def line to last line, nested functions counted on their own) p50 / p90 / max
  and the count over 40 lines, per folder;
- module-global mutable dicts in kernels/ (a module-level name bound to a dict literal,
  comprehension or `dict(...)` call: tuning state other code can mutate);
- environment reads at import: `os.environ` / `os.getenv` reached by module-level code of the
  installed package (outside function bodies; `setdefault` writes count too);
- repeated blocks among model/, engine/gpu/ and bench/, and among kernels/ and benchmarks/:
  pairs the `duplicates` tool lists whose two sides both lie there (identical runs and
  same-shape runs apart).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from collections import defaultdict
from pathlib import Path

PACKAGE = ("flashpd", "model", "engine", "kernels", "services", "bench")  # setup.py ROOTS
LONG_LINES = 40
DUP_FOLDERS = ("model/", "engine/gpu/", "bench/")
KERNEL_DUP_FOLDERS = ("kernels/", "benchmarks/")  # the kernels and their microbenchmarks
REPO = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout


def read_tree(rev: str) -> dict[str, str]:
    """path -> text of every tracked .py file at `rev` (WORKTREE: the working tree)."""
    if rev == "WORKTREE":
        paths = _git("ls-files", "--cached", "--others", "--exclude-standard").split()
        return {p: (REPO / p).read_text() for p in paths if p.endswith(".py") and (REPO / p).is_file()}
    paths = [p for p in _git("ls-tree", "-r", "--name-only", rev).split() if p.endswith(".py")]
    return {p: _git("show", f"{rev}:{p}") for p in paths}


def folder_of(path: str) -> str:
    return path.split("/", 1)[0] if "/" in path else "(root)"


def installed(path: str) -> bool:
    return folder_of(path) in PACKAGE and not path.startswith("bench/results/")


def code_lines(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.strip())


def function_lengths(text: str) -> list[int]:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    return [
        n.end_lineno - n.lineno + 1 for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def _is_dict(value: ast.AST | None) -> bool:
    if isinstance(value, (ast.Dict, ast.DictComp)):
        return True
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in ("dict", "defaultdict")


def global_dicts(text: str) -> list[str]:
    names = []
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and _is_dict(node.value):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and _is_dict(node.value) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return names


def _module_level(tree: ast.Module):
    """Nodes run at import: the module body and class bodies, not function bodies."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo += node.decorator_list if not isinstance(node, ast.Lambda) else []
            continue
        yield node
        todo += list(ast.iter_child_nodes(node))


def env_reads_at_import(text: str) -> int:
    count = 0
    for node in _module_level(ast.parse(text)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("environ", "getenv")
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ):
            count += 1
    return count


def percentile(values: list[int], q: float) -> int:
    if not values:
        return 0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(files: dict[str, str]) -> dict:
    lines, funcs = defaultdict(int), defaultdict(list)
    pkg_lines = unpkg_lines = 0
    for path, text in files.items():
        n = code_lines(text)
        lines[folder_of(path)] += n
        if installed(path):
            pkg_lines += n
        else:
            unpkg_lines += n
        funcs[folder_of(path)] += function_lengths(text)
    dicts = {p: d for p, t in files.items() if p.startswith("kernels/") for d in [global_dicts(t)] if d}
    env = {p: n for p, t in files.items() if installed(p) for n in [env_reads_at_import(t)] if n}
    return {
        "lines": dict(lines),
        "package": pkg_lines,
        "unpackaged": unpkg_lines,
        "funcs": dict(funcs),
        "dicts": dicts,
        "env": env,
    }


def duplicate_rows(rev: str) -> list[str]:
    """The `duplicates` tool's pair rows over the tree at `rev` (one run)."""
    if shutil.which("duplicates") is None:
        return ["`duplicates` is not on PATH"]
    with tempfile.TemporaryDirectory() as tmp:
        if rev == "WORKTREE":
            root = str(REPO)
        else:
            archive = Path(tmp) / "tree.tar"
            _git("archive", "-o", str(archive), rev)
            with tarfile.open(archive) as tar:
                tar.extractall(Path(tmp) / "tree")
            root = str(Path(tmp) / "tree")
        out = subprocess.run(
            ["duplicates", "--repo", root, "--most", "200", "--seconds", "300"],
            capture_output=True,
            text=True,
            cwd=root,
        ).stdout
    return out.splitlines()


def duplicate_pairs(lines: list[str], folders: tuple[str, ...]) -> tuple[int, int, list[str]]:
    """(identical, same-shape) pairs with both sides in `folders`, and their rows."""
    rows = [
        line
        for line in lines
        if re.match(r"^D\d+ (\S+):\S+ ~ (\S+):", line)
        and all(p.startswith(folders) for p in re.findall(r"(\S+?):\d", line)[:2])
    ]
    same = [r for r in rows if " shape" in r]
    return len(rows) - len(same), len(same), rows


def render(before: dict, after: dict, revs: tuple[str, str], dups: dict) -> str:
    b, a = revs
    out = [
        f"# Code shape: {b} -> {a}",
        "",
        f"Command: `python scripts/code_shape.py --before {b} --after {a}` (non-blank lines of .py files).",
        "",
        "## Code lines per top-level folder",
        "",
        f"| folder | installed | {b} | {a} | change |",
        "|---|---|---|---|---|",
    ]
    for folder in sorted(set(before["lines"]) | set(after["lines"])):
        x, y = before["lines"].get(folder, 0), after["lines"].get(folder, 0)
        out.append(f"| {folder} | {'yes' if folder in PACKAGE else 'no'} | {x:,} | {y:,} | {y - x:+,} |")
    out += [
        f"| **installed package** | | {before['package']:,} | {after['package']:,} | "
        f"{after['package'] - before['package']:+,} |",
        f"| **unpackaged** (tests, benchmarks, scripts, sdk, proto) | | "
        f"{before['unpackaged']:,} | {after['unpackaged']:,} | "
        f"{after['unpackaged'] - before['unpackaged']:+,} |",
        "",
        "## Function length (lines, def to end) per folder",
        "",
        f"| folder | {b} p50 / p90 / max / >{LONG_LINES} (of n) | {a} p50 / p90 / max / >{LONG_LINES} (of n) |",
        "|---|---|---|",
    ]
    for folder in sorted(set(before["funcs"]) | set(after["funcs"])):
        cells = []
        for m in (before, after):
            f = m["funcs"].get(folder, [])
            cells.append(
                f"{percentile(f, 0.5)} / {percentile(f, 0.9)} / {max(f, default=0)} / "
                f"{sum(x > LONG_LINES for x in f)} (of {len(f)})"
                if f
                else "-"
            )
        out.append(f"| {folder} | {cells[0]} | {cells[1]} |")

    def tuning(m: dict) -> int:  # launch-tuning state (CONFIG) vs caches, registries, tables
        return sum(d == "CONFIG" for names in m["dicts"].values() for d in names)

    out += [
        "",
        "## Module-global mutable dicts in kernels/",
        "",
        f"{b}: {sum(map(len, before['dicts'].values()))} ({tuning(before)} launch-tuning "
        f"CONFIG dicts); {a}: {sum(map(len, after['dicts'].values()))} ({tuning(after)} "
        "CONFIG); the rest are per-device caches, the registries and constant tables",
        "",
    ]
    out += [f"- {p}: {', '.join(d)}" for p, d in sorted(after["dicts"].items())]
    out += [
        "",
        "## Environment reads at import (installed package)",
        "",
        f"{b}: {sum(before['env'].values())}; {a}: {sum(after['env'].values())}",
        "",
    ]
    out += [f"- {p}: {n}" for p, n in sorted(after["env"].items())]
    for title, key in (("model/, engine/gpu/, bench/", "main"), ("kernels/, benchmarks/", "kernels")):
        out += ["", f"## Repeated blocks among {title} (`duplicates`)", ""]
        for rev in revs:
            same_text, shape, rows = dups[(rev, key)]
            out += [f"{rev}: {same_text} identical, {shape} same-shape", ""]
            out += [f"    {r}" for r in rows]
            out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default="7f5b989")
    ap.add_argument("--after", default="HEAD", help="a revision, or WORKTREE")
    ap.add_argument("--out", default=None, help="also write the markdown here")
    args = ap.parse_args(argv)
    revs = (args.before, args.after)
    before, after = measure(read_tree(args.before)), measure(read_tree(args.after))
    lines = {rev: duplicate_rows(rev) for rev in revs}
    dups = {
        (rev, key): duplicate_pairs(lines[rev], folders)
        for rev in revs
        for key, folders in (("main", DUP_FOLDERS), ("kernels", KERNEL_DUP_FOLDERS))
    }
    text = render(before, after, revs, dups)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
