"""The harness's own pieces that need no server: the Prefect database template's checks."""

from __future__ import annotations

import sqlite3

from ckptflow.harness import _usable


def test_only_a_migrated_prefect_database_is_used_as_a_template_and_a_damaged_one_is_removed(tmp_path):
    good = tmp_path / "good.db"
    con = sqlite3.connect(good)
    con.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
    con.execute("INSERT INTO alembic_version VALUES ('abc123')")
    con.commit()
    con.close()
    assert _usable(str(good)) and good.exists()
    empty = tmp_path / "empty.db"  # SQLite, but never migrated
    sqlite3.connect(empty).close()
    damaged = tmp_path / "damaged.db"
    damaged.write_bytes(b"not a database" * 100)
    for bad in (empty, damaged):
        assert not _usable(str(bad)) and not bad.exists(), bad
    assert not _usable(str(tmp_path / "missing.db"))
