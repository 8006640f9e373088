"""Webhook delivery from the outbox: signed, retried with backoff, never lost."""
