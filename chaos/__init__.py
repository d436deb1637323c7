"""A chaos harness for fanout: real workers, parents, PostgreSQL and Redis, faults on purpose.

``python -m chaos`` runs every scenario against its own database and its own Redis server,
prints one line of figures and a verdict per scenario, then ``N passed, M failed``. Each
handler call is written to a ledger (``tests.testapp.models.Execution``), so duplicates,
concurrency and admissions are counted from what ran, not guessed. See ``python -m chaos -h``.
"""
