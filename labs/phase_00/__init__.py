"""Phase 00 lab starters (generated; see each module's docstring)."""
