"""Phase 04 lab starters (generated; see each module's docstring)."""
