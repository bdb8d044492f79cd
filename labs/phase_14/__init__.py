"""Phase 14 lab starters (generated; see each module's docstring)."""
