"""``START_REPLICATION`` as :mod:`pgsieve.streaming.replication` writes it: names and
values from users (publication names) are quoted, never spliced; the LSN in the server's
X/Y form."""

from __future__ import annotations

from pgsieve.streaming.replication import start_command
from pgsieve.streaming.transports.base import PgoutputOptions


def test_the_command_quotes_the_slot_option_names_and_values() -> None:
    command = start_command('we"ird', (0x1A << 32) | 0x2B3C, {
        "proto_version": "2", "publication_names": "\"a'b\",plain"})
    assert command == (b'START_REPLICATION SLOT "we""ird" LOGICAL 1A/2B3C '
                       b'("proto_version" \'2\', "publication_names" \'"a\'\'b",plain\')')


def test_pgoutput_options_reach_the_command_as_pgoutput_parses_them() -> None:
    options = PgoutputOptions(publication_names=("pub", "Mixed Case"), proto_version=2,
                              messages=True, streaming=False).as_dict()
    command = start_command("s", 0, options).decode()
    assert command.startswith('START_REPLICATION SLOT "s" LOGICAL 0/0 (')
    assert "\"publication_names\" 'pub,\"Mixed Case\"'" in command
    assert "\"messages\" 'true'" in command and "streaming" not in command
