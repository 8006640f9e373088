"""Benchmarks that print figures (``make bench``); nothing here is asserted."""


def admin_url() -> str:
    """The Postgres server the benchmarks make their databases on: RINGWATCH_DATABASE_URL,
    else the embedded one (started if need be)."""
    from ringwatch.services.settings import Settings
    from ringwatch.services.store import db

    settings = Settings()
    return db.resolve_database_url(settings.database_url, settings.state_dir)
