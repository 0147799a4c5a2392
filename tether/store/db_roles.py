"""Least privilege in Tether's PostgreSQL: who owns the tables, who may do what with them.

The stores (tether/audit/sink.py, tether/policy/judgements.py, tether/store/effect_ledger.py)
create their tables themselves when they may (the dev stack: one role that owns everything). In
a deployment they must not: a role that owns the audit table can ``ALTER TABLE ... DISABLE
TRIGGER``, delete records and enable it again, and ``tether audit verify`` would not know. So the
production stack runs this module's ``setup`` once, as an administrator, and every service then
connects as a role that owns nothing:

- ``tether_owner`` (NOLOGIN: no service can be it) owns the database, the tables, the
  append-only trigger and its function;
- ``tether_worker`` writes records and judgements (INSERT, SELECT: never UPDATE, DELETE or
  TRUNCATE) and keeps the effect ledger (its claims change state: INSERT, SELECT, UPDATE on the
  ledger only);
- ``tether_cli`` and ``tether_inbox`` read (SELECT only);
- Temporal's own role (``temporal``) owns Temporal's databases, and no Tether service holds it.

Each login role's password is a secret of its own (a libpq passfile the service's DSN names with
``?passfile=``), written once by ``genpass``; ``setup`` sets each role's password from its file,
so rotating one is: write the file, run ``setup`` again, restart the service.

``python -m tether.store.db_roles sql`` prints the in-database part (roles, tables, grants) for a
managed PostgreSQL, where an administrator runs it with psql (docs/production.md).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from tether.store.effect_ledger import GENERATION_TABLE, LEDGER_TABLE, MARKER_TABLE, WITNESS_TABLE
from tether.store.effect_ledger import SCHEMA as LEDGER_SCHEMA
from tether.store.tables import AUDIT_SCHEMA, AUDIT_TABLE, JUDGEMENT_SCHEMA, JUDGEMENT_TABLE
from tether.store.postgres import redact_dsn

OWNER = "tether_owner"
WRITER = "tether_worker"
READERS = ("tether_cli", "tether_inbox")
DEFAULT_DATABASE = "tether_audit"
ADMIN_DSN_ENV = "TETHER_DB_ADMIN_DSN"

# What a worker may do with each table: records and judgements are append-only (INSERT ... ON
# CONFLICT DO NOTHING needs no UPDATE); the ledger's claims move through states (UPDATE); the
# ledger's marker is written once (by setup, or by a worker in the dev stack).
WRITER_GRANTS = {
    AUDIT_TABLE: "SELECT, INSERT",
    JUDGEMENT_TABLE: "SELECT, INSERT",
    LEDGER_TABLE: "SELECT, INSERT, UPDATE",
    MARKER_TABLE: "SELECT, INSERT",
    # The ledger's generation and its witness move on with every new claim.
    GENERATION_TABLE: "SELECT, INSERT, UPDATE",
    WITNESS_TABLE: "SELECT, INSERT, UPDATE",
}


def _role_clause(role: str, login: bool) -> str:
    attrs = "LOGIN" if login else "NOLOGIN"
    return (f"    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN "
            f"CREATE ROLE {role} {attrs}; END IF;\n")


def script(writer: str = WRITER, readers: tuple[str, ...] = READERS) -> str:
    """The in-database SQL, run by an administrator connected to Tether's database (its owner
    must be ``tether_owner``: ``CREATE DATABASE tether_audit OWNER tether_owner``). Idempotent."""
    tables = list(WRITER_GRANTS)
    everyone = ", ".join([writer, *readers])
    roles = "".join([_role_clause(OWNER, False), _role_clause(writer, True), *(_role_clause(r, True) for r in readers)])
    grants = "".join(f"GRANT {privs} ON {table} TO {writer};\n" for table, privs in WRITER_GRANTS.items())
    return f"""-- Tether's roles, tables and grants (tether/store/db_roles.py).
DO $$ BEGIN
{roles}END $$;
-- The administrator acts as the owner to create what it owns (a CREATEROLE role may grant this).
GRANT {OWNER} TO CURRENT_USER;
SET ROLE {OWNER};
{AUDIT_SCHEMA.strip()}
{JUDGEMENT_SCHEMA.strip()}
{LEDGER_SCHEMA.strip()}
INSERT INTO {MARKER_TABLE} (ledger) VALUES ('{LEDGER_TABLE}') ON CONFLICT DO NOTHING;
REVOKE ALL ON {", ".join(tables)} FROM PUBLIC;
{grants}GRANT SELECT ON {", ".join(tables)} TO {", ".join(readers)};
RESET ROLE;
-- Nobody but the owner creates anything here; only Tether's roles connect.
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
GRANT USAGE ON SCHEMA public TO {everyone};
DO $$ BEGIN
    EXECUTE format('REVOKE ALL ON DATABASE %I FROM PUBLIC', current_database());
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO {everyone}', current_database());
END $$;
"""


# ----------------------------------------------------------------------------- secrets


def read_pgpass(path: Path) -> tuple[str, str]:
    """(role, password) of a passfile line ``host:port:database:role:password`` (genpass's)."""
    line = next((l for l in path.read_text().splitlines() if l.strip() and not l.startswith("#")), "")
    fields = line.split(":")
    if len(fields) != 5 or not fields[3] or not fields[4]:
        raise ValueError(f"{path}: not a passfile line host:port:database:role:password")
    return fields[3], fields[4]


def _write_new(path: Path, text: str, mode: int) -> bool:
    """Write ``text`` to ``path`` unless it exists (False then): never a second password."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, mode)  # whatever the umask
    return True


def genpass(passwords: list[str], pgpasses: list[tuple[str, str]]) -> list[str]:
    """A random password in each file missing: a plain one (read by another image's user:
    PostgreSQL's, Temporal's; mode 0644, its volume is its boundary) or a libpq passfile for a
    Tether service (mode 0600: libpq refuses a passfile others can read). Returns what it wrote."""
    written = []
    for path in passwords:
        if _write_new(Path(path), secrets.token_urlsafe(32) + "\n", 0o644):
            written.append(path)
    for role, path in pgpasses:
        if _write_new(Path(path), f"*:*:*:{role}:{secrets.token_urlsafe(32)}\n", 0o600):
            written.append(path)
    return written


# ----------------------------------------------------------------------------- setup


def _password(path: str) -> str:
    value = Path(path).read_text().strip()
    if not value:
        raise ValueError(f"{path} is empty")
    return value


def setup(admin_dsn: str, *, database: str = DEFAULT_DATABASE, writer: str | None = None,
          readers: Sequence[str] = (), temporal: tuple[str, str] | None = None) -> list[str]:
    """As the administrator of ``admin_dsn``: Temporal's role (``temporal`` = (role, password
    file): LOGIN CREATEDB, no superuser), Tether's database owned by ``tether_owner``, its
    tables, roles and grants (:func:`script`), each login role's password from its passfile.
    ``writer`` / ``readers``: passfiles. Idempotent. Returns what it did, a line each."""
    import psycopg
    from psycopg import sql

    done = []
    writer_role, writer_pw = read_pgpass(Path(writer)) if writer else (WRITER, None)
    reader_roles: list[tuple[str, str | None]] = [read_pgpass(Path(r)) for r in readers] or [(r, None) for r in READERS]
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        if temporal:
            role, pw_file = temporal
            exists = admin.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
            if not exists:
                admin.execute(sql.SQL("CREATE ROLE {} LOGIN CREATEDB").format(sql.Identifier(role)))
                done.append(f"role {role} created (Temporal's: LOGIN CREATEDB)")
            admin.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(role), sql.Literal(_password(pw_file))))
        admin.execute(f"DO $$ BEGIN\n{_role_clause(OWNER, False)}END $$")
        if not admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone():
            admin.execute(f"GRANT {OWNER} TO CURRENT_USER")
            admin.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(database), sql.Identifier(OWNER)))
            done.append(f"database {database} created, owned by {OWNER}")
    in_database = psycopg.conninfo.make_conninfo(admin_dsn, dbname=database)
    with psycopg.connect(in_database, autocommit=True) as conn:
        with conn.transaction():
            conn.execute(script(writer_role, tuple(r for r, _ in reader_roles)))
        for role, pw in [(writer_role, writer_pw), *reader_roles]:
            if pw is not None:
                conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(role), sql.Literal(pw)))
        done.append(f"{database}: tables owned by {OWNER}; {writer_role} writes, {', '.join(r for r, _ in reader_roles)} read")
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tether.store.db_roles", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("genpass", help="write each password file that is missing")
    gen.add_argument("--password", action="append", default=[], metavar="FILE", help="a plain password (0644)")
    gen.add_argument("--pgpass", action="append", default=[], nargs=2, metavar=("ROLE", "FILE"),
                     help="a libpq passfile for ROLE (0600)")
    up = sub.add_parser("setup", help="roles, database, tables and grants, as the administrator")
    up.add_argument("--admin-dsn", default=os.environ.get(ADMIN_DSN_ENV),
                    help=f"the administrator's postgresql:// URL (default ${ADMIN_DSN_ENV})")
    up.add_argument("--admin-password-file", metavar="FILE", help="the administrator's password (else the DSN's)")
    up.add_argument("--database", default=DEFAULT_DATABASE)
    up.add_argument("--writer", metavar="PGPASS", help="the workers' passfile")
    up.add_argument("--reader", action="append", default=[], metavar="PGPASS", help="a reader's passfile (cli, inbox)")
    up.add_argument("--temporal", nargs=2, metavar=("ROLE", "PASSWORD_FILE"), help="Temporal's own role")
    sub.add_parser("sql", help="print the in-database SQL (roles, tables, grants) for psql")
    args = parser.parse_args(argv)
    if args.command == "sql":
        print(script())
        return 0
    try:
        if args.command == "genpass":
            for path in genpass(args.password, [tuple(p) for p in args.pgpass]):
                print(f"wrote {path}")
            return 0
        if not args.admin_dsn:
            print(f"setup: no administrator: --admin-dsn or {ADMIN_DSN_ENV}", file=sys.stderr)
            return 2
        admin = args.admin_dsn
        if args.admin_password_file:
            from psycopg.conninfo import make_conninfo

            admin = make_conninfo(admin, password=_password(args.admin_password_file))
        for line in setup(admin, database=args.database, writer=args.writer, readers=args.reader,
                          temporal=tuple(args.temporal) if args.temporal else None):
            print(line)
        return 0
    except (OSError, ValueError) as e:
        print(f"{parser.prog} {args.command}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the driver's errors: one line, never the password
        if type(e).__module__.startswith("psycopg"):
            print(f"{parser.prog} setup: {redact_dsn(args.admin_dsn)}: {' '.join(str(e).split())[:300]}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
