"""Keys and seals: the journal's encryption at rest, idempotency keys, resealing under a new key."""
