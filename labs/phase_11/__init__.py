"""Phase 11 lab starters (generated; see each module's docstring)."""
