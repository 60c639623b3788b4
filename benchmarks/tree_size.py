"""The size of the package's save path, encoding and distribution at two git revisions.

Counts the Python lines of repo/, engine/, format/, tiers/ and dist/, and of codecs/, which
holds the codecs that were in format/ (as `wc -l` does), each directory's share, the longest file and the longest function, at `--base` and at `--rev`, read
from git (the working tree is not looked at). What the consolidation's targets are measured by:

    python -m benchmarks tree_size --base dbafe2f --rev HEAD
"""

import ast
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

DIRS = ("repo", "engine", "format", "codecs", "tiers", "dist")


def git(*args: str) -> str:
    """What `git args` prints, run in this checkout."""
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout


def measure(rev: str) -> dict:
    """{"lines", "per_dir", "longest_file", "longest_function"} of the DIRS' Python files at `rev`."""
    files = [f for f in git("ls-tree", "-r", "--name-only", rev, "src/forkpoint").split()
             if f.endswith(".py") and f.split("/")[2] in DIRS]
    per_dir, longest_file, longest_fn = dict.fromkeys(DIRS, 0), (0, ""), (0, "")
    for path in files:
        text = git("show", f"{rev}:{path}")
        n = text.count("\n")
        per_dir[path.split("/")[2]] += n
        longest_file = max(longest_file, (n, path))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                longest_fn = max(longest_fn, (node.end_lineno - node.lineno + 1, f"{path}:{node.name}"))
    return {"lines": sum(per_dir.values()), "per_dir": per_dir, "longest_file": longest_file,
            "longest_function": longest_fn}


def main() -> None:
    ap = harness.arguments(__doc__, repeats=None, directory=False)
    ap.add_argument("--base", default="dbafe2f", help="the revision to compare against")
    ap.add_argument("--rev", default="HEAD", help="the revision measured")
    args = ap.parse_args()
    measured = []
    for rev in (args.base, args.rev):
        try:
            measured.append(measure(rev))
        except subprocess.CalledProcessError as e:
            ap.error(f"git could not read revision {rev!r}: {e.stderr.strip()} (give a revision of this checkout)")
    base, now = measured
    rows = [[f"{d}/", base["per_dir"][d], now["per_dir"][d]] for d in DIRS]
    rows.append(["all of them", base["lines"], f"{now['lines']} ({now['lines'] / base['lines'] - 1:+.0%})"])
    rows.append(["longest file", "{} ({})".format(*base["longest_file"]), "{} ({})".format(*now["longest_file"])])
    rows.append(["longest function", "{} ({})".format(*base["longest_function"]),
                 "{} ({})".format(*now["longest_function"])])
    harness.table(["Python lines", args.base, args.rev], rows)


if __name__ == "__main__":
    main()
