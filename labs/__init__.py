"""Your workspace: one package of lab starters per phase."""
