"""Phase 10 lab starters (generated; see each module's docstring)."""
