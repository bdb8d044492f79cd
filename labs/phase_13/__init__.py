"""Phase 13 lab starters (generated; see each module's docstring)."""
