"""Phase 17 lab starters (generated; see each module's docstring)."""
