"""SQLAlchemy models and every query ringwatch runs: all SQL lives here."""
