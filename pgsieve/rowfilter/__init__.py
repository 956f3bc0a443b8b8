"""Row-filter rules: parse, validate against a source, and combine across publications.

* :mod:`.parse` — pure: one ``WHERE`` expression, parsed by PostgreSQL's grammar
  (pglast), normalized, with forbidden constructs flagged.
* :mod:`.rules` — pure: PostgreSQL's row-filter/column-list rules on catalog facts.
* :mod:`.catalog` — I/O (psycopg 3): validate against a source, always rolled back
  (:mod:`.probe` the session, :mod:`.facts` the table's facts, :mod:`.dryrun` PostgreSQL's
  resolution and dry runs, :mod:`.nodetree` — pure — what it resolved to).
* :mod:`.effective` — pure: what several publications combined replicate per table.

Every problem is a :class:`FilterIssue` with a stable :class:`IssueCode`.
"""

from pgsieve.rowfilter.catalog import (
    ColumnListValidation,
    FilterValidation,
    validate_column_list,
    validate_filter,
)
from pgsieve.rowfilter.effective import (
    EffectiveFilter,
    InitialSync,
    Publication,
    PublishedTable,
    Redundancy,
    TableInfo,
    effective_filters,
    initial_sync_plan,
    publication_tables,
)
from pgsieve.rowfilter.facts import read_table_facts
from pgsieve.rowfilter.parse import (
    ColumnReference,
    FilterIssue,
    FilterParseError,
    IssueCode,
    ParsedFilter,
    TableNameError,
    parse_filter,
    parse_table_name,
)
from pgsieve.rowfilter.probe import SourceConnectionError
from pgsieve.rowfilter.rules import (
    ReplicaIdentity,
    TableFacts,
    column_list_issues,
)

__all__ = [
    "ColumnListValidation",
    "ColumnReference",
    "EffectiveFilter",
    "FilterIssue",
    "FilterParseError",
    "FilterValidation",
    "InitialSync",
    "IssueCode",
    "ParsedFilter",
    "Publication",
    "PublishedTable",
    "Redundancy",
    "ReplicaIdentity",
    "SourceConnectionError",
    "TableFacts",
    "TableInfo",
    "TableNameError",
    "column_list_issues",
    "effective_filters",
    "initial_sync_plan",
    "parse_filter",
    "parse_table_name",
    "publication_tables",
    "read_table_facts",
    "validate_column_list",
    "validate_filter",
]
