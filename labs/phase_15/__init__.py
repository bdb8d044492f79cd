"""Phase 15 lab starters (generated; see each module's docstring)."""
