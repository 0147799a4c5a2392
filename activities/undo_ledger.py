"""The undo ledger's old import path: the ledger is now the effect ledger (tether/store/effect_ledger.py),
which guards every write, undos included, in the same file and table."""

from tether.store.effect_ledger import (  # noqa: F401
    LEDGER_FILE,
    LEDGER_TABLE,
    EffectLedger,
    LedgerEntry,
    LedgerUnavailable,
    PostgresUndoLedger,
    SqliteUndoLedger,
    UndoLedger,
    ledger_for,
)
