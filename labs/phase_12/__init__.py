"""Phase 12 lab starters (generated; see each module's docstring)."""
