"""What Tether keeps where the audit sink is, named in one place: the folder of the JSON-lines
sink (and of the files beside it), and the PostgreSQL tables the audit sink
(tether/audit/sink.py) and the judgement log (tether/policy/judgements.py) write, with their
schemas. The stores import them from here, and so do the database's roles (tether/store/db_roles.py):
what owns and grants the tables reads no store."""

# The audit sink's folder (TETHER_AUDIT_DIR), with the judgement log and the local effect ledger
# beside its folders.
DEFAULT_AUDIT_DIR = ".tether/audit"

AUDIT_TABLE = "tether_audit"
JUDGEMENT_TABLE = "tether_judgements"

AUDIT_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {AUDIT_TABLE} (
    workflow_id    text        NOT NULL,
    run_id         text        NOT NULL,
    seq            bigint      NOT NULL,
    first_run_id   text        NOT NULL,
    continued_from text,
    record         jsonb       NOT NULL,
    written_at     timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT {AUDIT_TABLE}_key UNIQUE (workflow_id, run_id, seq)
);
CREATE OR REPLACE FUNCTION {AUDIT_TABLE}_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '{AUDIT_TABLE} is append-only: % refused', TG_OP;
END $$;
CREATE OR REPLACE TRIGGER {AUDIT_TABLE}_append_only BEFORE UPDATE OR DELETE ON {AUDIT_TABLE}
    FOR EACH ROW EXECUTE FUNCTION {AUDIT_TABLE}_append_only();
"""

JUDGEMENT_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {JUDGEMENT_TABLE} (
    workflow_id text NOT NULL,
    run_id text NOT NULL,
    activity_id text NOT NULL,
    idx integer NOT NULL,
    tenant text NOT NULL,
    at timestamptz NOT NULL,
    line jsonb NOT NULL,
    PRIMARY KEY (workflow_id, run_id, activity_id, idx)
);
CREATE INDEX IF NOT EXISTS {JUDGEMENT_TABLE}_at ON {JUDGEMENT_TABLE} (at);
"""
