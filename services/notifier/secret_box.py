"""Webhook secrets at rest: Fernet-encrypted under ``RINGWATCH_SECRET_KEY``.

A stored secret is ``fernet:<token>``; one without the prefix was stored in plain text
before encryption existed. It is still read, and the notifier seals it once a key is set.
"""

from __future__ import annotations

import base64
import binascii
from functools import lru_cache

from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.pbkdf2 import PBKDF2HMAC

from ringwatch.services.config import PLACEHOLDER_SECRET
from ringwatch.services.errors import NotConfigured
from ringwatch.services.settings import LOCAL_KEY_FILE, Settings, local_secret_key

SEALED_PREFIX = "fernet:"
MIN_PASSPHRASE = 16
# Fixed, so the same passphrase gives the same key in every process (the API seals, the
# notifier opens); the passphrase itself must carry the entropy.
_SALT = b"ringwatch webhook secrets v1"
_ITERATIONS = 600_000


class SecretUnreadable(Exception):
    """A sealed secret that this key cannot open (no key, or another one)."""


class SecretBox:
    def __init__(self, key: bytes) -> None:
        self._fernet = Fernet(key)

    @classmethod
    def from_setting(cls, value: str) -> SecretBox:
        """A Fernet key is used as it is; anything else is a passphrase a key is derived from."""
        return cls(_key_from(value.strip()))

    def seal(self, secret: str) -> str:
        return SEALED_PREFIX + self._fernet.encrypt(secret.encode()).decode("ascii")

    def open(self, stored: str) -> str:
        """The secret in clear; one stored before encryption existed passes through."""
        if not is_sealed(stored):
            return stored
        try:
            return self._fernet.decrypt(stored.removeprefix(SEALED_PREFIX).encode("ascii")).decode()
        except InvalidToken:
            raise SecretUnreadable("the webhook secret does not decrypt with RINGWATCH_SECRET_KEY "
                                   "(was the key changed?)") from None


def is_sealed(stored: str) -> bool:
    return stored.startswith(SEALED_PREFIX)


def open_secret(box: SecretBox | None, stored: str) -> str:
    """``box.open``, where there may be no box: then only a plain-text secret can be read."""
    if box is None and is_sealed(stored):
        raise SecretUnreadable("RINGWATCH_SECRET_KEY is unset, so the webhook secret cannot be decrypted")
    return stored if box is None else box.open(stored)


def box_from_settings(settings: Settings) -> SecretBox | None:
    """The configured key; in the demo without one, the key a server of this machine alone
    generates once under the state dir (``Settings.with_local_defaults``)."""
    value = settings.secret_key.get_secret_value()
    if not value and settings.demo:
        value = local_secret_key(settings.state_dir / LOCAL_KEY_FILE)
    return SecretBox.from_setting(value) if value else None


def require_box(settings: Settings) -> SecretBox:
    box = box_from_settings(settings)
    if box is None:
        raise NotConfigured("webhook secrets are stored encrypted: set RINGWATCH_SECRET_KEY (a Fernet key, "
                            "or a passphrase of 16 characters or more) on the API and the notifiers")
    return box


@lru_cache(maxsize=4)
def _key_from(value: str) -> bytes:
    if _is_fernet_key(value):
        return value.encode("ascii")
    if len(value) < MIN_PASSPHRASE or PLACEHOLDER_SECRET in value.lower():
        raise NotConfigured(f"RINGWATCH_SECRET_KEY must be a Fernet key or a passphrase of "
                            f"{MIN_PASSPHRASE} characters or more, not a placeholder")
    kdf = PBKDF2HMAC(algorithm=hashes.SHA256(), length=32, salt=_SALT, iterations=_ITERATIONS)
    return base64.urlsafe_b64encode(kdf.derive(value.encode()))


def _is_fernet_key(value: str) -> bool:
    try:
        return len(value) == 44 and len(base64.urlsafe_b64decode(value.encode("ascii"))) == 32
    except (binascii.Error, UnicodeEncodeError, ValueError):
        return False
