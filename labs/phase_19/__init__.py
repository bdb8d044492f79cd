"""Phase 19 lab starters (generated; see each module's docstring)."""
