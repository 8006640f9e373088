"""``ringwatch selftest``: what an operator runs on a new node, with no Ray and no API."""
