"""Turn a live unpartitioned table into a RANGE-partitioned one without a long lock; resumable.

``convert_to_partitioned(table, column)`` builds a partitioned *shadow* ``<table>_partitioned``
next to the live table, keeps it in step with every write, copies the existing rows into it in
committed batches, verifies both tables in one snapshot and swaps the names in one short
transaction. Phases, recorded in ``metadata_table_conversion`` (made by the tool itself; ``state``)
so a rerun goes on from where a crash stopped, each done by one module::

    prepared   shadow made: LIKE the source, PARTITION BY RANGE (column), primary key = source
               PK + column, a DEFAULT partition, the partitions holding rows and the ones ahead,
               the source's other indexes and FOREIGN KEYs                            (``shadow``)
    armed      a row trigger on the source mirrors every write into the shadow, in the
               writer's own transaction                                               (``mirror``)
    copying    rows copied in keyset batches over the PK, up to the largest key that existed
               once the trigger was in place; the cursor is committed with each batch (``copying``)
    copied     every batch done
    verified   count and checksum of both tables equal, in ONE REPEATABLE READ snapshot
                                                                                (``verification``)
    swapped    one short transaction: drop the trigger, source -> ``<table>_unpartitioned``,
               shadow -> ``<table>``, indexes take the source's names                   (``swap``)
    dropped    ``<table>_unpartitioned`` dropped (``drop_old``)                         (``swap``)

No write is lost or left stale: the trigger fires in the writer's transaction, so a source
change and its mirror commit or roll back together and every snapshot sees both or neither; each
module's docstring says why its phase keeps that true under concurrent writers. ``source`` reads
the table and refuses what cannot be converted; ``converter`` runs the phases in order;
``context`` holds what they share.
"""
from __future__ import annotations

from metadata.partitions.conversion.converter import (
    TABLE_CONVERSION_LOCK,
    ConversionReport,
    TableConverter,
    convert_to_partitioned,
)
from metadata.partitions.conversion.source import SourceShape, relkind
from metadata.partitions.conversion.state import PHASES, STATE_TABLE, ConversionState, conversion_state
from metadata.partitions.errors import TableConversionError

__all__ = ["PHASES", "STATE_TABLE", "TABLE_CONVERSION_LOCK", "ConversionReport", "ConversionState", "SourceShape",
           "TableConversionError", "TableConverter", "conversion_state", "convert_to_partitioned", "relkind"]
