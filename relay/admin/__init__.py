"""The command line (`relay ...`) and what only the operator runs: migrations, the
schema options migrate builds on request, the dead-letter tools and the typed rows of
`relay status`. Nothing else in the relay imports `cli` (an import-linter contract).
"""
