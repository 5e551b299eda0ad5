"""Operator command for the partition lifecycle.

    manage.py partitions status
    manage.py partitions rotate [--dry-run] [--now 2026-03-01T12:00:00+00:00]
    manage.py partitions archive <partition>
    manage.py partitions restore <archive.copy.gz> [--into TABLE] [--attach]
    manage.py partitions restore-day <YYYY-MM-DD> [--attach]   (sessions with their tokens and candidates)
    manage.py partitions schedule

Every failure (a ``PartitionError``, or a mistake in the arguments) is one line on stderr and exit
status 1; progress goes to stdout, step by step. ``rotate --dry-run`` prints the plan and changes
nothing.
"""
from __future__ import annotations

import datetime as dt
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DEFAULT_DB_ALIAS

from metadata.archival import UNFINISHED, ArchivalError, restore_archive
from metadata.archival.families import archived_days, restore_day
from metadata.models import PARTITIONED_TABLES, ArchivalStep, PartitionArchivalJob
from core.beat_jobs import declared_jobs, register_jobs
from metadata.partitions import PartitionError, PartitionRotation, catalog


class OneLineErrorParser(CommandParser):
    """Usage mistakes are one line too (argparse would print the whole usage first)."""

    def error(self, message: str) -> None:
        if self.called_from_command_line:
            self.exit(2, f"{self.prog}: error: {message}\n")
        raise CommandError(f"Error: {message}")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _moment(now: str | None) -> dt.datetime | None:
    """``--now`` as an aware datetime; a mistake in it is the command's one-line error."""
    if not now:
        return None
    try:
        moment = dt.datetime.fromisoformat(now)
    except ValueError as exc:
        raise CommandError(f"partitions rotate: {_one_line(exc)}") from exc
    if moment.tzinfo is None:
        raise CommandError(f"partitions rotate: --now {now!r} needs a UTC offset, e.g. {now}+00:00")
    return moment


class Command(BaseCommand):
    help = "Partition lifecycle: status, rotate, archive <partition>, restore <archive>, schedule."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.__class__ = OneLineErrorParser  # subparsers inherit the class (argparse uses type(self))
        actions = parser.add_subparsers(dest="action", required=True)
        actions.add_parser("status", help="partitions, bounds, sizes, the DEFAULT partition, open jobs")
        rotate = actions.add_parser("rotate", help="premake, drain DEFAULT, archive expired partitions")
        rotate.add_argument("--now", help="ISO time with offset to rotate as of (default: now)")
        rotate.add_argument("--dry-run", action="store_true",
                            help="print what the rotation would create, drain, archive and drop; change nothing")
        archive = actions.add_parser("archive", help="archive one partition now, whatever its age")
        archive.add_argument("partition")
        restore = actions.add_parser("restore", help="re-import an archive and verify its checksum")
        restore.add_argument("archive")
        restore.add_argument("--into", help="table name to restore into (default: the partition's name)")
        restore.add_argument("--attach", action="store_true", help="attach the restored table to its parent")
        restore_day = actions.add_parser("restore-day", help="restore a day's archived sessions with their "
                                                             "tokens and candidates, each verified")
        restore_day.add_argument("day", help="the day's start, e.g. 2026-11-01 (UTC)")
        restore_day.add_argument("--attach", action="store_true", help="attach the restored tables to their parents")
        actions.add_parser("schedule", help="register every app's beat jobs in django-celery-beat (idempotent)")

    def handle(self, *args, action: str, **options) -> None:
        try:
            getattr(self, f"do_{action.replace('-', '_')}")(**options)
        except PartitionError as exc:
            raise CommandError(f"partitions {action}: {_one_line(exc)}") from exc

    def say(self, line: str) -> None:
        self.stdout.write(line)

    # ------------------------------------------------------------------ actions
    def do_status(self, **_) -> None:
        for parent, column in PARTITIONED_TABLES.items():
            partitions = catalog.range_partitions(parent, sizes=True)
            self.say(f"{parent} (RANGE on {column}): {len(partitions)} partition(s)")
            for p in partitions:
                self.say(f"  {p.name:40} {p.bounds.start:%Y-%m-%d %H:%M} .. {p.bounds.end:%Y-%m-%d %H:%M} UTC"
                         f"  ~{p.estimated_rows} rows  {p.total_bytes // 1024} KiB")
            state = catalog.default_state(parent, column)
            if state is None:
                self.say("  no DEFAULT partition")
            else:
                span = f" ({state.oldest:%Y-%m-%d %H:%M} .. {state.newest:%Y-%m-%d %H:%M})" if state.rows else ""
                self.say(f"  DEFAULT {state.name}: {state.rows} row(s){span}  {state.total_bytes // 1024} KiB")
        jobs = PartitionArchivalJob.objects.using(DEFAULT_DB_ALIAS).filter(step__in=UNFINISHED).order_by("range_start")
        for job in jobs:
            detail = f" at {job.failed_step}: {job.error}" if job.step == ArchivalStep.FAILED else ""
            self.say(f"archival job {job.pk} {job.partition}: {job.step}{detail}")

    def do_rotate(self, now: str | None = None, dry_run: bool = False, **_) -> None:
        plan = PartitionRotation(progress=self.say).plan(_moment(now))
        if dry_run:
            plan.print(self.say)
            self.say("dry run: nothing changed")
            return
        self.say(f"plan: {plan.summary()}")
        report = plan.apply()
        self.say(report.summary())
        if report.failed:
            raise ArchivalError(f"{len(report.failed)} archival job(s) failed; first: {report.failed[0]}")

    def do_archive(self, partition: str, **_) -> None:
        job = PartitionRotation(progress=self.say).archive_one(partition)
        if job.step != ArchivalStep.DROPPED:
            raise ArchivalError(f"{partition} failed at {job.failed_step}: {job.error} (rerun to resume)")
        self.say(f"{partition}: {job.row_count} row(s) archived to {job.archive_path}")

    def do_restore(self, archive: str, into: str | None = None, attach: bool = False, **_) -> None:
        result = restore_archive(Path(archive), into=into, attach=attach, progress=self.say)
        where = "attached to its parent" if result.attached else "as a standalone table"
        self.say(f"restored {result.rows} row(s) into {result.table} {where}; checksum {result.checksum}")

    def do_restore_day(self, day: str, attach: bool = False, **_) -> None:
        try:
            start = dt.datetime.fromisoformat(day)
        except ValueError as exc:
            raise CommandError(f"partitions restore-day: {_one_line(exc)}") from exc
        start = start if start.tzinfo else start.replace(tzinfo=dt.timezone.utc)
        jobs = PartitionArchivalJob.objects.using(DEFAULT_DB_ALIAS).filter(range_start=start)
        found = next((d for d in archived_days(jobs) if d.bounds.start == start), None)
        if found is None:
            raise CommandError(f"partitions restore-day: no archived day of sessions starts at {start.isoformat()}")
        results = restore_day(found, attach=attach, skip=lambda job: catalog.relation_exists(job.partition),
                              progress=self.say)
        if not results:
            self.say(f"{start:%Y-%m-%d}: every table of the day is restored already")
        for result in results:
            where = "attached to its parent" if result.attached else "as a standalone table"
            self.say(f"restored {result.rows} row(s) into {result.table} {where}; checksum {result.checksum}")

    def do_schedule(self, **_) -> None:
        created = register_jobs(declared_jobs(), registered_by="partitions schedule")
        self.say(f"registered: {', '.join(created)}" if created else "all periodic tasks already registered")
