"""The `forkpoint` commands that look after a repository's storage: verify, compact, gc, du."""

import sys
from dataclasses import asdict

import click
from rich.table import Table

from ..errors import ForkpointError
from ..policy import Keep
from .common import (_emit, _open, _progress, _ratio, _size, _working, console, json_option, numeric_metrics,
                     repo_option)


@click.command()
@click.argument("ref", required=False)
@repo_option
@json_option
def verify(ref, repo_url, as_json):
    """Re-hash every object of REF (default: of every version)."""
    repo = _open(repo_url)
    ids = [repo.resolve(ref)] if ref else None
    total = 0
    for vid in ids or repo.version_ids():
        try:
            total += sum(leaf.nbytes for leaf in repo.manifest(vid).leaves if leaf.alias_of is None)
        except ForkpointError:
            pass  # a damaged manifest: verify reports it
    progress, total, label = _progress(total, "verifying")
    with progress:
        task = progress.add_task(label, total=total)
        report = repo.verify(ref, progress=lambda n: progress.advance(task, n))
    if as_json:
        _emit(asdict(report) | {"ok": report.ok})
    else:
        for problem in report.problems:
            console.print(f"[red]problem:[/red] {problem}")
        status = "[green]ok[/green]" if report.ok else f"[red]{len(report.problems)} problem(s)[/red]"
        console.print(f"{status}: {report.versions} version(s), {report.objects} chunk(s), "
                      f"{_size(report.bytes)} verified")
    sys.exit(0 if report.ok else 1)


@click.command()
@click.argument("refs", nargs=-1)
@click.option("--codec", type=click.Choice(["lossless", "zstd"]), default="lossless", show_default=True,
              help="how to encode the raw objects")
@repo_option
@json_option
def compact(refs, codec, repo_url, as_json):
    """Encode in place the raw objects of REFS (default: of every version)."""
    repo = _open(repo_url)
    ids = [repo.resolve(ref) for ref in refs] or [v.id for v in repo.versions()]
    sizes: dict[str, int] = {}
    for vid in ids:
        for c in (c for leaf in repo.manifest(vid).leaves for c in leaf.chunks if not c.delta):
            sizes[c.object] = max(sizes.get(c.object, 0), c.start + c.size)
    progress, total, label = _progress(sum(sizes.values()) * len(repo.stores), "compacting")
    with progress:
        task = progress.add_task(label, total=total)
        report = repo.compact(ids, codec=codec, progress=lambda n: progress.advance(task, n))
    if as_json:
        _emit(asdict(report))
    else:
        for problem in report.problems:
            console.print(f"[red]problem:[/red] {problem}")
        console.print(f"{report.encoded} of {report.objects} object(s) encoded, {_size(report.saved_bytes)} "
                      f"saved, in {report.versions} version(s)")
    sys.exit(1 if report.problems else 0)


@click.command()
@click.option("--keep-last", type=click.IntRange(min=1), default=None, help="keep the newest N versions per branch")
@click.option("--keep-every", type=click.IntRange(min=1), default=None,
              help="keep versions whose step is a multiple of K")
@click.option("--keep-best", default=None, help="METRIC:K:min|max")
@click.option("--branch", "branch_names", multiple=True, help="apply retention to these branches only")
@click.option("--grace", type=click.FloatRange(min=0), default=600.0, show_default=True,
              help="seconds: keep objects younger than this (protects saves in flight)")
@click.option("--dry-run", is_flag=True, help="report what would be freed, change nothing")
@repo_option
@json_option
def gc(keep_last, keep_every, keep_best, branch_names, grace, dry_run, repo_url, as_json):
    """Apply retention, then delete unreferenced objects."""
    best = None
    if keep_best:
        parts = keep_best.rsplit(":", 2)
        if len(parts) != 3 or not parts[1].isdigit() or parts[2] not in ("min", "max"):
            raise click.BadParameter(f"{keep_best!r}: expected METRIC:K:min|max, e.g. val_loss:3:min",
                                     param_hint="--keep-best")
        best = (parts[0], int(parts[1]), parts[2])
    given = keep_last is not None or keep_every is not None or best is not None
    keep = Keep(last=keep_last, every=keep_every, best=best) if given else None
    repo = _open(repo_url)
    if best is not None:
        _check_best_recorded(repo, best[0], list(branch_names) or list(repo.branches()))
    with _working("collecting garbage (pruning, then listing objects)"):
        report = repo.gc(keep=keep, branches=list(branch_names) or None, dry_run=dry_run, grace=grace)
    if as_json:
        return _emit(asdict(report))
    verb = "would free" if dry_run else "freed"
    click.echo(f"{verb} {_size(report.freed_bytes)}: {len(report.pruned_versions)} version(s) pruned, "
               f"{report.deleted_objects} object(s), {report.deleted_manifests} orphan manifest(s), "
               f"{report.deleted_temp} temp file(s)")
    if report.kept_young:
        why = (f"another process is writing to {', '.join(report.others_writing)}, so the {grace:.0f} s grace "
               "period applies" if report.others_writing else "no other process is writing, but a save of the last "
               "few seconds may still use them")
        click.echo(f"kept {report.kept_young} unreferenced object(s) or temp file(s): {why}")
    elif not (report.deleted_objects or report.deleted_manifests or report.deleted_temp or report.pruned_versions):
        click.echo("nothing to free: every object is used by a version" + ("" if keep else
                   " (pass --keep-last/--keep-every/--keep-best to prune old versions)"))
    if report.left_alone:
        shown = ", ".join(report.left_alone[:5]) + (" ..." if len(report.left_alone) > 5 else "")
        click.echo(f"left alone {len(report.left_alone)} file(s) under objects/ whose names are not objects': {shown}")


def _check_best_recorded(repo, metric: str, branches: list[str]) -> None:
    """Refuse --keep-best by a metric no version of `branches` records (a misspelt name would
    keep no best version, and the pruning cannot be undone)."""
    recorded = numeric_metrics(repo, branches)
    if metric not in recorded:
        raise click.BadParameter(f"no version of {', '.join(sorted(branches)) or 'any branch'} records metric {metric!r} as a "
                                 f"number, so none would be kept as best; nothing was pruned. Numeric metrics recorded: "
                                 f"{', '.join(sorted(recorded)) or '(none)'}", param_hint="--keep-best")


@click.command()
@repo_option
@json_option
def du(repo_url, as_json):
    """Logical vs stored bytes per version and per branch; what each branch holds on the store
    (its unpruned versions' objects, delta bases included) and what only it needs."""
    usage = _open(repo_url).du()
    if as_json:
        return _emit(usage)
    table = Table("version", "branch", "step", "logical", "stored", "ratio")
    for v in usage["versions"]:
        table.add_row(v["id"][:12] + (" (pruned)" if v["pruned"] else ""), v["branch"], str(v["step"]),
                      _size(v["logical_bytes"]), _size(v["stored_bytes"]),
                      _ratio(v["logical_bytes"], v["stored_bytes"], 1))
    console.print(table)
    table = Table("branch", "versions", "logical", "stored", "held", "only this branch")
    for name, b in usage["branches"].items():
        table.add_row(name, str(b["versions"]), _size(b["logical_bytes"]), _size(b["stored_bytes"]),
                      _size(b["held_bytes"]), _size(b["exclusive_bytes"]))
    console.print(table)
    table = Table("codec", "objects", "decoded", "stored", "ratio")
    for codec, c in usage["codecs"].items():
        table.add_row(codec, str(c["objects"]), _size(c["decoded_bytes"]), _size(c["stored_bytes"]),
                      _ratio(c["decoded_bytes"], c["stored_bytes"], 2))
    console.print(table)
    console.print(f"objects on storage: {_size(usage['objects_bytes'])}")
