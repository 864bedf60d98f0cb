"""Worker plumbing shared by the prefill and decode roles: config, the engine worker base, the
Serve deployment base with its Redis publisher, admission queue and the pinned request router."""
